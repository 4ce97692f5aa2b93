"""Reading an input: all (or n) of its batches, and two runs of batches compared exactly."""

import numpy as np


def drain(inp, n=None):
    out = []
    while n is None or len(out) < n:
        try:
            out.append(inp.get_next())
        except StopIteration:
            break
    return out


def assert_batches_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)
