"""The pipeline knobs' errors: stages, repeats, schedules and microbatches that do not fit say so
when the config is built."""

import dataclasses

import pytest


def test_pipeline_knob_errors():
    from equipax.core.knobs import ConfigError
    from equipax.core.mesh import PIPELINE_AXES, MeshConfig
    from equipax.core.nn import TransformerConfig
    from equipax.core.nn.pipeline import check_pipeline

    base = TransformerConfig(num_layers=6)
    with pytest.raises(ValueError, match=r"num_layers=6 is not divisible by pipeline_stages x pipeline_repeats = 4"):
        dataclasses.replace(base, pipeline_stages=4)
    with pytest.raises(ValueError, match=r"pipeline_stages x pipeline_repeats = 2 x 2 = 4"):
        dataclasses.replace(base, pipeline_stages=2, pipeline_schedule="circular", pipeline_repeats=2)
    with pytest.raises(ValueError, match=r"pipeline_repeats=2 needs pipeline_schedule='circular'"):
        dataclasses.replace(base, pipeline_stages=2, pipeline_repeats=2)
    with pytest.raises(ValueError, match=r"'circular' needs pipeline_repeats >= 2"):
        dataclasses.replace(base, pipeline_stages=2, pipeline_schedule="circular")
    with pytest.raises(ValueError, match=r"set one of them"):
        dataclasses.replace(base, pipeline_stages=2, pipeline_microbatches=2, pipeline_microbatch_size=4)
    with pytest.raises(ValueError, match=r"tensor_parallel='gspmd'"):
        dataclasses.replace(base, pipeline_stages=2, tensor_parallel="shard_map")

    cfg = dataclasses.replace(base, pipeline_stages=2, pipeline_microbatches=4)
    mesh = MeshConfig(ici_mesh_shape=(2, 1, 2, 2), dcn_mesh_shape=(1, 1, 1, 1), axis_names=PIPELINE_AXES)
    check_pipeline(cfg, mesh, 16)  # fits
    with pytest.raises(
        ConfigError, match=r"pipeline_stages=2 but the mesh's `stage` axis has size 1.*axis_names=\('stage', 'data'"
    ):
        check_pipeline(cfg, MeshConfig(ici_mesh_shape=(1, 4, 2)), 16)
    with pytest.raises(ConfigError, match=r"pipeline_stages=4 but the mesh's `stage` axis has size 2"):
        check_pipeline(dataclasses.replace(cfg, num_layers=8, pipeline_stages=4), mesh, 16)
    with pytest.raises(ConfigError, match=r"global batch 18 is not divisible into 4 microbatches"):
        check_pipeline(cfg, mesh, 18)
    with pytest.raises(
        ConfigError, match=r"not divisible into microbatches of model.transformer.pipeline_microbatch_size=3"
    ):
        check_pipeline(dataclasses.replace(cfg, pipeline_microbatches=None, pipeline_microbatch_size=3), mesh, 16)
    with pytest.raises(ConfigError, match=r"microbatch of 2 examples .* does not split evenly over the 4"):
        check_pipeline(
            cfg, MeshConfig(ici_mesh_shape=(2, 2, 2, 1), dcn_mesh_shape=(1, 1, 1, 1), axis_names=PIPELINE_AXES), 8
        )
    # A -1 (flexible) axis: the batch is checked once the mesh is fitted to the devices.
    flexible = MeshConfig(ici_mesh_shape=(2, 1, -1, 2), dcn_mesh_shape=(1, 1, 1, 1), axis_names=PIPELINE_AXES)
    check_pipeline(cfg, flexible, 2)
    with pytest.raises(ConfigError, match=r"microbatch of 4 examples .* over the 8 data x fsdp"):
        check_pipeline(cfg, flexible.fit(32), 16)
    circular = dataclasses.replace(
        base, num_layers=8, pipeline_stages=4, pipeline_schedule="circular", pipeline_repeats=2, pipeline_microbatches=2
    )
    with pytest.raises(ConfigError, match=r"circular schedule needs at least as many microbatches as stages"):
        check_pipeline(
            circular, MeshConfig(ici_mesh_shape=(4, 1, 1, 1), dcn_mesh_shape=(1, 1, 1, 1), axis_names=PIPELINE_AXES), 16
        )
