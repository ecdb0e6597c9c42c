"""The ZeRO files of a checkpoint's pipeline stages (one tensor-parallel rank) read as one
model's: Megatron-DeepSpeed's PipelineModule names its parameters per stage ("3.mlp...",
"tied_modules.embed...") and the first and last stage both hold the tied word embeddings.
"""

from megatron.errors import CheckpointError


class JoinedStages:
    """The readers of zero/checkpoint/whole_params.py of each stage (in stage order) as one
    reader, in the whole model's names: `rename(name)` gives a stage's parameter its whole-
    model name (None: not a parameter this trainer's model has). A name several stages hold
    is read from the first: the last stage's copy of the tied embeddings (its word embeddings
    are trained alike, its position embeddings not used at all).
    """

    def __init__(self, readers, rename, where):
        self.where = {}  # whole-model name -> (the stage's reader, the stage's name)
        for reader in readers:
            for name in reader.names():
                joined = rename(name)
                if joined is None:
                    raise CheckpointError(f"{where}: the ZeRO files hold {name}, a parameter of "
                                          "no layer this trainer's GPT model has")
                self.where.setdefault(joined, (reader, name))
        hyper = [[{k: v for k, v in group.items() if k not in ("params", "step")}
                  for group in reader.param_groups] for reader in readers]
        if any(stage != hyper[0] for stage in hyper):
            raise CheckpointError(f"{where}: the pipeline stages' optimizers have different "
                                  "param groups; they were not saved by one run")
        self.param_groups = readers[0].param_groups
        self.loss_scaler = readers[0].loss_scaler

    def names(self):
        return list(self.where)

    def has(self, name):
        return name in self.where

    def _call(self, method, name, *args):
        reader, stage_name = self.where[name]
        return getattr(reader, method)(stage_name, *args)

    def group_of(self, name):
        return self._call("group_of", name)

    def master(self, name, numel):
        return self._call("master", name, numel)

    def per_element_keys(self, name):
        return self._call("per_element_keys", name)

    def state(self, name, key, numel):
        return self._call("state", name, key, numel)

    def scalar_state(self, name):
        return self._call("scalar_state", name)

    def table(self, name, key):
        return self._call("table", name, key)
