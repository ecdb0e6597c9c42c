"""Start-up notes for DeepSpeed JSON keys that parse but would do nothing in this run, as
DeepSpeed reads them too: an offload section with no device, NVMe paths for a CPU offload,
stage 3 keys at a lower stage, the option of a loader the trainer does not use. Each is one
line; none stops the run (the same JSON is valid for DeepSpeed, and the launch scripts switch
stages with a flag)."""

import dataclasses

from zero.config.sections import ZeroConfig

_OFFLOADS = ("offload_optimizer", "offload_param")
# the stage 3 keys of zero_optimization, under every spelling zero accepts
_STAGE3_KEYS = {spelling for field in dataclasses.fields(ZeroConfig)
                if field.name.startswith("stage3_")
                for spelling in (field.name, *field.metadata["aliases"])}


def unused_key_notes(config, source):
    """One note per key of the parsed `config` (its final dict: `config.raw`) that does
    nothing here; DeepSpeed config `source` (for messages)."""
    notes = []
    zero = config.raw.get("zero_optimization")
    zero = zero if isinstance(zero, dict) else {}
    for name in _OFFLOADS:
        section = zero.get(name)
        if not isinstance(section, dict):
            continue
        path = f"zero_optimization.{name}"
        if "device" not in section:
            notes.append(f" note: '{path}' names no \"device\" (the default is \"none\"), so "
                         "nothing is offloaded; add \"device\": \"cpu\" or \"nvme\"")
        elif section.get("nvme_path") and section["device"] != "nvme":
            notes.append(f" note: '{path}.nvme_path' not used: the device is "
                         f"\"{section['device']}\", not \"nvme\"")
    stage = config.zero_optimization.stage
    stage3 = sorted(key for key in zero if key in _STAGE3_KEYS)
    if stage3 and stage != 3:
        notes.append(f" note: {', '.join(f'zero_optimization.{key}' for key in stage3)} not "
                     f"used: only ZeRO stage 3 reads them, and the stage is {stage}")
    if config.dataloader_drop_last:
        notes.append(" note: 'dataloader_drop_last' not used: it is for the loader of "
                     "zero.initialize's training_data, and the trainer reads its data through "
                     "its own sampler, which gives every iteration a whole global batch")
    return tuple(notes)
