"""Model (tensor and pipeline) parallel utilities, with Megatron-LM's names.

Layers and communication ops for splitting a transformer across `model_parallel_size`
ranks; every function also works in a single process without torch.distributed.
"""

from megatron.mpu.cross_entropy import vocab_parallel_cross_entropy
from megatron.mpu.data import broadcast_data
from megatron.mpu.grads import clip_grad_norm, get_grad_norm
from megatron.mpu.initialize import (ParallelState, destroy_model_parallel,
                                     get_data_parallel_group, get_data_parallel_rank,
                                     get_data_parallel_world_size, get_model_parallel_group,
                                     get_model_parallel_rank, get_model_parallel_src_rank,
                                     get_model_parallel_world_size, get_parallel_state,
                                     get_pipeline_model_parallel_group,
                                     get_pipeline_model_parallel_next_rank,
                                     get_pipeline_model_parallel_prev_rank,
                                     get_pipeline_model_parallel_rank,
                                     get_pipeline_model_parallel_stage_rank,
                                     get_pipeline_model_parallel_world_size,
                                     get_virtual_pipeline_model_parallel_rank,
                                     get_virtual_pipeline_model_parallel_world_size,
                                     set_virtual_pipeline_model_parallel_rank,
                                     is_pipeline_first_stage, is_pipeline_last_stage,
                                     initialize_model_parallel, model_parallel_is_initialized,
                                     set_model_parallel_rank, set_model_parallel_world_size)
from megatron.mpu.layers import (ColumnParallelLinear, RowParallelLinear, ShardRows,
                                 VocabParallelEmbedding, init_method_normal,
                                 initialize_affine_weight, initialize_replicated_weight,
                                 scaled_init_method_normal,
                                 set_model_parallel_attributes)
from megatron.mpu.mappings import (copy_to_model_parallel_region,
                                   gather_from_model_parallel_region,
                                   reduce_from_model_parallel_region,
                                   scatter_to_model_parallel_region)
from megatron.mpu.random import (CudaRNGStatesTracker, RNGStatesTracker, checkpoint,
                                 get_cuda_rng_tracker, model_parallel_cuda_manual_seed)
from megatron.mpu.utils import (VocabUtility, divide, ensure_divisibility,
                                split_tensor_along_last_dim)
