"""The spec's parallelism checks that need the model: a TP that does not split the model's
heads (`check_tp_fits_model`) and a pipeline split that does not fit its layers
(`check_pp_fits_model`), at `kvrelay validate` and at start (`check_fits_model`: both); and, at
start, whether every replica fits the Ray cluster's resources at once (`check_fits_cluster`). Each
problem names its field, as every spec problem does. Prefill and decode may differ in TP: the KV
transfer reshards the heads between them (`kvtransfer.reshard`); a pipeline-parallel prefill
hands each rank's layers to the decode ranks by global layer id."""
from __future__ import annotations

from cluster.spec_errors import SpecError
from cluster.types import Stage


def check_tp_fits_model(tp_sizes: dict[Stage, int], model_config) -> None:
    """Each stage's tensor_parallel_size splits the model's heads and MLP (``model_config``: an
    ``engine.config.ModelConfig``). Raises SpecError naming ``<stage>.tensor_parallel_size``."""
    from engine.parallel.sharding import check_tensor_parallel

    _raise_problems({stage: lambda tp=tp: check_tensor_parallel(model_config, tp) for stage, tp in tp_sizes.items()})


def check_pp_fits_model(pipelines: dict[Stage, tuple[int, tuple[int, ...] | None]], model_config) -> None:
    """Each stage's (pipeline_parallel_size, pipeline_layer_split) fits the model's layers: the split sums to
    them, or, with no split, every stage gets at least one. Raises SpecError naming
    ``<stage>.pipeline_layer_split`` (with the split's sum and the model's layer count) or
    ``<stage>.pipeline_parallel_size``."""
    from engine.parallel.sharding import pipeline_layers

    _raise_problems({stage: lambda pp=pp, split=split: pipeline_layers(model_config.num_layers, pp, split)
                     for stage, (pp, split) in pipelines.items()})


def check_fits_model(stages: dict, model_config) -> None:
    """Both checks over ``stages`` (Stage -> a spec's StageSpec or a launcher's StageConfig), every
    problem of both reported at once."""
    problems = []
    for check, of in ((check_tp_fits_model, lambda s: s.tensor_parallel_size),
                      (check_pp_fits_model, lambda s: (s.pipeline_parallel_size, _split(s.pipeline_layer_split)))):
        try:
            check({stage: of(s) for stage, s in stages.items()}, model_config)
        except SpecError as e:
            problems += e.problems
    if problems:
        raise SpecError(problems)


def _split(split) -> tuple[int, ...] | None:
    return tuple(split) if split else None


def _raise_problems(checks: dict) -> None:
    from engine.config import ConfigError

    problems = []
    for stage, check in checks.items():
        try:
            check()
        except ConfigError as e:
            problems.append(f"{stage.value}.{e}")
    if problems:
        raise SpecError(problems)


def resource_demand(stages: dict) -> dict[str, dict[Stage, float]]:
    """Ray resource -> stage -> what its replicas ask for in all (replicas x ranks x each rank's
    bundle, `cluster.tp_ranks.rank_bundle`), from a launcher's StageConfigs."""
    from cluster.tp_ranks import rank_bundle

    demand: dict[str, dict[Stage, float]] = {}
    for stage, sc in stages.items():
        for name, amount in rank_bundle(sc.ray_options).items():
            demand.setdefault(name, {})[stage] = sc.num_replicas * sc.num_ranks * amount
    return demand


def check_fits_cluster(stages: dict, cluster_resources: dict[str, float]) -> None:
    """Every replica of every stage can be placed at once on a cluster of ``cluster_resources``
    (`ray.cluster_resources()`): otherwise a replica would wait for resources nobody frees until
    the start times out. Raises SpecError naming each resource short, with what each stage asks
    for (replicas x ranks x per rank) and what the cluster has."""
    problems = []
    for name, by_stage in resource_demand(stages).items():
        need, have = sum(by_stage.values()), float(cluster_resources.get(name, 0.0))
        if any(stages[st].num_ranks > 1 and amount / stages[st].num_replicas > have + 1e-9
               for st, amount in by_stage.items()):
            continue  # one multi-rank replica alone does not fit: its placement is refused naming its bundles
        if need > have + 1e-9:
            parts = ", ".join(
                f"{stage.value} {stages[stage].num_replicas} x {stages[stage].num_ranks} rank(s) x "
                f"{amount / (stages[stage].num_replicas * stages[stage].num_ranks):g}"
                for stage, amount in by_stage.items())
            problems.append(f"resources: the stages ask for {need:g} {name} in all ({parts}) and the Ray "
                            f"cluster has {have:g}; lower a stage's replicas or its resources per rank "
                            f"(fractions such as num_cpus: 0.5 share a core)")
    if problems:
        raise SpecError(problems)
