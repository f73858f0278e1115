"""The spec's tensor-parallel checks that need the model: a TP that does not split the model's
heads (`check_tp_fits_model`, at `kvrelay validate` and at start). Each problem names its
field, as every spec problem does. Prefill and decode may differ in TP: the KV transfer
reshards the heads between them (`kvtransfer.reshard`)."""
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
