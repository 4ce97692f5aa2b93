"""Mesh configs: device-count errors name the numbers; on CPU the DCN axes are outermost."""

import pytest


def test_mesh_errors_name_the_numbers():
    from equipax.core.knobs import ConfigError
    from equipax.core.mesh import MeshConfig, check_device_count

    with pytest.raises(ConfigError, match="needs 128 devices .* but 8 are available"):
        check_device_count(MeshConfig(ici_mesh_shape=(1, 64, 1), dcn_mesh_shape=(2, 1, 1)), 8)
    with pytest.raises(ValueError, match="has 2 entries"):
        MeshConfig(ici_mesh_shape=(1, 4))


def test_cpu_mesh_puts_dcn_outermost():
    # 2 slices x 4 devices: devices 0-3 form slice 0 (one host), 4-7 slice 1.
    import numpy as np

    from equipax.core.mesh import MeshConfig, _cpu_hybrid

    arr = _cpu_hybrid(np.arange(8), MeshConfig(ici_mesh_shape=(1, 4, 1), dcn_mesh_shape=(2, 1, 1)))
    assert arr.shape == (2, 4, 1)
    assert arr[0].ravel().tolist() == [0, 1, 2, 3] and arr[1].ravel().tolist() == [4, 5, 6, 7]
    arr = _cpu_hybrid(np.arange(8), MeshConfig(ici_mesh_shape=(1, 2, 2), dcn_mesh_shape=(2, 1, 1)))
    assert arr[0].ravel().tolist() == [0, 1, 2, 3]
