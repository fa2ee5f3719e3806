"""A checkpoint's weights after the job, for DeepSpeed zero_to_fp32's users (docs/checkpoints.md).

    from offloadpp.checkpoint_utils import get_fp32_state_dict_from_checkpoint
    state_dict = get_fp32_state_dict_from_checkpoint(save_dir)  # the tag `latest` names
    model.load_state_dict(state_dict)

    export_checkpoint(save_dir, out_dir)  # `offloadpp export save_dir out_dir`: a Hugging Face folder, streamed

The names of offloadpp.runtime.checkpoint_weights, where they live.
"""

from offloadpp.runtime.checkpoint_weights import (
    WeightsDoNotFitError,
    export_checkpoint,
    get_fp32_state_dict_from_checkpoint,
)

__all__ = ["WeightsDoNotFitError", "export_checkpoint", "get_fp32_state_dict_from_checkpoint"]
