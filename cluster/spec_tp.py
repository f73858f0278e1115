"""The spec's tensor-parallel checks that span stages or need the model: a TP that does not
split the model's heads (`check_tp_fits_model`, at `kvrelay validate` and at start), and
disaggregated TP, refused until the per-rank KV transfer (`disaggregated_tp_problems`).
Each problem names its field, as every spec problem does."""
from __future__ import annotations

from cluster.spec_errors import SpecError
from cluster.types import Stage


def check_tp_fits_model(tp_sizes: dict[Stage, int], model_config) -> None:
    """Each stage's tensor_parallel_size splits the model's heads and MLP (``model_config``: an
    ``engine.config.ModelConfig``). Raises SpecError naming ``<stage>.tensor_parallel_size``."""
    from engine.config import ConfigError
    from engine.parallel.sharding import check_tensor_parallel

    problems = []
    for stage, tp in tp_sizes.items():
        try:
            check_tensor_parallel(model_config, tp)
        except ConfigError as e:
            problems.append(f"{stage.value}.{e}")
    if problems:
        raise SpecError(problems)


def disaggregated_tp_problems(prefill: int, decode: int) -> list[str]:
    """Tensor parallelism on a KV-moving stage needs the per-rank transfer, not in yet."""
    if prefill != decode:
        return [f"decode.tensor_parallel_size: {decode} differs from prefill.tensor_parallel_size ({prefill}): "
                "heterogeneous tensor parallelism needs the per-rank KV transfer (each decode rank receives "
                "its heads from the prefill ranks that hold them), which is not in yet"]
    if prefill > 1:
        return [f"prefill.tensor_parallel_size: {prefill} in mode disaggregated needs the per-rank KV transfer "
                "(every rank's heads moved), which is not in yet; use mode: colocated for tensor parallelism"]
    return []
