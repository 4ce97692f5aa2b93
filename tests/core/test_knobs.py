import dataclasses
from typing import Literal

import pytest


@dataclasses.dataclass(frozen=True, kw_only=True)
class Inner:
    num_layers: int = 2
    activation: Literal["gelu", "relu"] = "gelu"
    cap: float | None = 50.0
    mesh: tuple[int, ...] = (1, 1, 1)

    def __post_init__(self):
        if self.num_layers <= 0:
            raise ValueError(f"num_layers must be positive, got {self.num_layers}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Outer:
    name: str = "x"
    lr: float = 1e-3
    use_thing: bool = False
    model: Inner = dataclasses.field(default_factory=Inner)


def test_parse_literal_never_evaluates_code():
    from equipax.core.knobs import parse_literal

    assert parse_literal("3") == 3
    assert parse_literal("1e-3") == 1e-3
    assert parse_literal("true") is True and parse_literal("False") is False
    assert parse_literal("None") is None
    assert parse_literal("(1, 4, 1)") == (1, 4, 1)
    assert parse_literal("[1, 2]") == [1, 2]
    assert parse_literal("hello") == "hello"
    # Code is kept as a plain string, never run.
    assert parse_literal("__import__('os').system('echo hi')") == "__import__('os').system('echo hi')"


def test_overrides_apply_and_record_sources():
    from equipax.core.knobs import apply_overrides

    cfg, sources = apply_overrides(
        Outer(),
        [
            "model.num_layers=4",
            "lr=3e-4",
            "use_thing=true",
            "model.mesh=[1,4,1]",
            "model.cap=None",
            "model.activation=relu",
            "name=run1",
        ],
    )
    assert cfg.model.num_layers == 4 and cfg.lr == 3e-4 and cfg.use_thing is True
    assert cfg.model.mesh == (1, 4, 1) and cfg.model.cap is None and cfg.model.activation == "relu"
    assert cfg.name == "run1"
    assert sources["model.num_layers"] == "--set" and sources["model.cap"] == "--set"
    assert sources["model.activation"] == "--set"
    assert Outer().model.num_layers == 2  # the original is untouched (frozen)


def test_a_literal_none_value_is_set_as_written():
    """`--set knob=none` of a choice that has the value "none" (model.quantization, remat) is that
    value, not Python's None (which `none` otherwise parses as, for `float | None` knobs)."""
    from equipax.core.knobs import apply_overrides

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Choice:
        mode: Literal["none", "int8"] = "int8"

    for text in ("none", "None"):
        assert apply_overrides(Choice(), [f"mode={text}"])[0].mode == "none"


def test_int_accepted_for_float_knob():
    from equipax.core.knobs import apply_overrides

    cfg, _ = apply_overrides(Outer(), ["lr=1"])
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float)


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.num_layer=3", "did you mean 'model.num_layers'"),
        ("num_layers=3", "did you mean 'model.num_layers'"),
        ("model.num_layers=three", "expects int"),
        ("model.num_layers=2.5", "expects int"),
        ("model.activation=selu", "must be one of 'gelu', 'relu'"),
        ("use_thing=3", "expects bool"),
        ("model.mesh=[1,'a']", "expects int"),
        ("model=3", "is a group of knobs"),
        ("model.num_layers", "not of the form KNOB=VALUE"),
        ("model.num_layers=0", "num_layers must be positive"),
    ],
)
def test_override_errors_are_actionable(override, message):
    from equipax.core.knobs import ConfigError, apply_overrides

    with pytest.raises(ConfigError) as e:
        apply_overrides(Outer(), [override])
    assert message.lower() in str(e.value).lower()


def test_json_round_trip():
    from equipax.core.knobs import apply_overrides, from_json, to_json

    cfg, _ = apply_overrides(Outer(), ["model.mesh=(2,2,2)", "model.cap=None"])
    again = from_json(Outer, to_json(cfg))
    assert again == cfg


def test_from_dict_unknown_key():
    from equipax.core.knobs import ConfigError, from_dict

    with pytest.raises(ConfigError, match="Did you mean 'num_layers'"):
        from_dict(Inner, {"num_layerz": 3})


def test_format_knobs_marks_sources():
    from equipax.core.knobs import apply_overrides, format_knobs

    cfg, sources = apply_overrides(Outer(), ["lr=0.5"])
    text = format_knobs(cfg, sources)
    assert "lr" in text and "0.5  # --set" in text
    line = next(ln for ln in text.splitlines() if ln.startswith("model.num_layers "))
    assert line.split("=", 1)[1].strip() == "2  # experiment"


def test_moved_knobs_name_their_new_path_and_old_dicts_still_read():
    """A class lists the knobs it moved (`RENAMED`): `--set` with an old path fails naming the new
    one, and a saved dict with old keys reads them at their new place."""
    import dataclasses
    from typing import ClassVar

    import pytest

    from equipax.core.knobs import ConfigError, apply_overrides, from_dict, renamed_knob

    @dataclasses.dataclass(frozen=True)
    class Sample:
        tokens: int = 1

    @dataclasses.dataclass(frozen=True)
    class Loop:
        steps: int = 10
        sample: Sample = dataclasses.field(default_factory=Sample)
        RENAMED: ClassVar[dict[str, str]] = {"sample_tokens": "sample.tokens"}

    @dataclasses.dataclass(frozen=True)
    class Root:
        train: Loop = dataclasses.field(default_factory=Loop)

    assert renamed_knob(Root(), "train.sample_tokens") == "train.sample.tokens"
    assert renamed_knob(Root(), "train.steps") is None
    with pytest.raises(ConfigError, match=r"'train.sample_tokens': it moved. Did you mean 'train.sample.tokens'\?"):
        apply_overrides(Root(), ["train.sample_tokens=3"])
    assert from_dict(Root, {"train": {"steps": 4, "sample_tokens": 3}}) == Root(train=Loop(steps=4, sample=Sample(3)))
    assert from_dict(Root, {"train": {"sample": {"tokens": 5}}}).train.sample.tokens == 5
