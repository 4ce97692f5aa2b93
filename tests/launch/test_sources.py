"""Input sources as classes (`equipax.launch.configs.sources`): `data.source` names one registered
class, which checks its knobs at config time and builds this host's inputs from one HostShard."""

from typing import ClassVar

import numpy as np
import pytest

from equipax.core.knobs import ConfigError, apply_overrides
from equipax.launch.configs.sources import HostShard, Source, register_source, registered_sources
from equipax.launch.configs.token_sources import SourceInputs, TokenSource
from equipax.launch.experiments.registry import get_experiment


def test_every_builtin_source_is_registered_under_its_kind():
    assert list(registered_sources("lm"))[:3] == ["shakespeare", "synthetic", "c4"]  # + this module's own
    assert list(registered_sources("image_classification")) == ["synthetic", "digits"]


@pytest.mark.parametrize(
    "exp, value, expected",
    [
        (
            "shakespeare_tiny",
            "shakespear",
            ["'data.source'", "'shakespeare', 'synthetic', 'c4'", "Did you mean 'shakespeare'"],
        ),
        ("cnn_tutorial", "digit", ["'data.source'", "'synthetic', 'digits'", "Did you mean 'digits'"]),
        ("cnn_tutorial", "c4", ["'data.source'", "'synthetic', 'digits'", "got 'c4'"]),
    ],
)
def test_an_unknown_source_is_a_config_error_listing_the_registered_ones(exp, value, expected):
    with pytest.raises(ConfigError) as info:
        apply_overrides(get_experiment(exp), [f"data.source={value}"])
    text = " ".join(str(info.value).split())
    assert all(e in text for e in expected), text


def test_packing_names_the_sources_that_pack_documents():
    with pytest.raises(ConfigError) as info:
        apply_overrides(get_experiment("shakespeare_tiny"), ["data.packing=true"])
    assert (
        "applies to data.source='c4' or data.source='chat' or data.source='play_chat'; got data.source='shakespeare'"
        in " ".join(str(info.value).split())
    )


def test_a_source_checks_its_own_knobs_at_config_time():
    with pytest.raises(ConfigError, match="data.source='c4' needs data.path"):
        apply_overrides(get_experiment("shakespeare_tiny"), ["data.source=c4"])
    with pytest.raises(ConfigError, match="data.validation_plays is empty"):
        apply_overrides(get_experiment("shakespeare_tiny"), ["data.validation_plays=()"])


def test_a_class_without_a_name_is_refused_at_registration():
    class Nameless(Source):
        kind: ClassVar[str] = "lm"

    with pytest.raises(TypeError, match="needs a class attribute `name`"):
        register_source(Nameless)


STREAM = np.arange(1, 1 + 64 * 33, dtype=np.int32) % 250 + 3  # 64 windows of 33 tokens, each different


@register_source
class CountingTokens(TokenSource):
    """A source of the test's own: windows of a known stream (so each row's origin shows)."""

    name: ClassVar[str] = "test_counting"
    uses_tokenizer: ClassVar[bool] = False

    def build(self, data, *, tokenizer, vocab_size, eval_batches, shard):
        from equipax.data import TokenWindowInput

        window = dict(seq_len=data.seq_len, seed=data.seed, **shard.input_kwargs())
        return SourceInputs(
            TokenWindowInput(STREAM, repeat=True, **window), TokenWindowInput(STREAM, repeat=False, **window)
        )


def test_a_new_source_is_one_class_and_each_host_gets_its_own_share(tmp_path):
    """Registered in this module, `data.source=test_counting` is a valid knob value, and
    build_lm_inputs hands it one HostShard per host: two hosts read disjoint windows of the
    stream, together a whole epoch, each row one of the stream's windows."""
    from equipax.launch.tasks.lm_data import build_lm_inputs, build_tokenizer

    cfg, _ = apply_overrides(
        get_experiment("shakespeare_tiny"),
        ["data.source=test_counting", "data.seq_len=32", "data.batch_size=8", "model.vocab_size=256"],
    )
    tokenizer = build_tokenizer(cfg, tmp_path)  # no vocabulary to train: the ids need none
    assert not list(tmp_path.iterdir())
    windows = {tuple(STREAM[i * 33 : (i + 1) * 33 - 1]) for i in range(64)}
    seen = []
    for host in (0, 1):
        inputs = build_lm_inputs(cfg, tokenizer, num_infeed_hosts=2, infeed_host_index=host)
        rows = [tuple(r) for _ in range(8) for r in inputs.train.get_next()["ids"]]
        assert len(rows) == 32 and set(rows) <= windows
        seen.append(set(rows))
    assert not seen[0] & seen[1] and len(seen[0] | seen[1]) == 64


def test_host_shard_refuses_an_index_outside_the_hosts():
    assert HostShard(count=4, index=3, batch_size=2).input_kwargs() == {
        "batch_size": 2,
        "num_infeed_hosts": 4,
        "infeed_host_index": 3,
    }
    with pytest.raises(ValueError, match="0 <= index < count"):
        HostShard(count=2, index=2, batch_size=1)


def test_the_config_layer_knows_the_built_in_chat_templates():
    """`data.chat_template` is checked at config time without importing equipax.data (so `launch
    list` / `show` need no JAX); the names it accepts are the data package's templates."""
    from equipax.data.chat import BUILTIN_TEMPLATES
    from equipax.launch.configs.chat_sources import CHAT_TEMPLATES

    assert set(CHAT_TEMPLATES) == set(BUILTIN_TEMPLATES)


def _counting_bytes():
    """The byte tokenizer, counting the documents it encodes (`.encoded`)."""
    from equipax.data import ByteTokenizer

    class Counting(ByteTokenizer):
        encoded = 0

        def encode(self, text):
            self.encoded += 1
            return super().encode(text)

    return Counting()


def test_packed_c4_documents_count_their_tokens_once_per_job(tmp_path):
    """The packing's token counts (one encoding pass over a split) are written to the job's
    data_cache/ on the first start and read back on the next, which encodes only the few documents
    it checks them with; counts that do not match the documents are computed again; another
    tokenizer or other shards are other files."""
    import json

    data_dir = tmp_path / "c4"
    data_dir.mkdir()
    for split, n in (("train", 300), ("validation", 40)):
        lines = [json.dumps({"text": f"document {i} " + "word " * (i % 17)}) for i in range(n)]
        (data_dir / f"c4-{split}.00000-of-00001.json").write_text("\n".join(lines) + "\n")
    cfg, _ = apply_overrides(
        get_experiment("shakespeare_tiny"),
        ["data.source=c4", f"data.path={data_dir}", "data.tokenizer=byte", "data.packing=True", "data.seq_len=32"],
    )
    cache = tmp_path / "job" / "data_cache"

    def build():
        tok = _counting_bytes()
        inputs = cfg.data.token_source.build(
            cfg.data, tokenizer=tok, vocab_size=384, eval_batches=1, shard=HostShard(batch_size=4), cache_dir=cache
        )
        return tok, inputs

    first_tok, first = build()
    assert first_tok.encoded >= 340  # every document of both splits
    files = sorted(p.name for p in cache.iterdir())
    assert (
        len(files) == 2
        and files[0].startswith("document_lengths-eval-")
        and files[1].startswith("document_lengths-train-")
    )
    again_tok, again = build()
    assert again_tok.encoded <= 8  # four documents checked per split
    np.testing.assert_array_equal(again.train.document_lengths(), first.train.document_lengths())
    for _ in range(3):
        a, b = first.train.get_next(), again.train.get_next()
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
    # Counts that are not these documents' (same file name): computed again, and rewritten.
    train_file = cache / files[1]
    wrong = first.train.document_lengths().copy()
    wrong[0] += 1
    with train_file.open("wb") as f:
        np.save(f, wrong)
    fixed_tok, fixed = build()
    assert fixed_tok.encoded >= 300
    np.testing.assert_array_equal(np.load(train_file), first.train.document_lengths())
    np.testing.assert_array_equal(fixed.train.document_lengths(), first.train.document_lengths())
    # More documents in a shard: another file, computed from the documents.
    with (data_dir / "c4-train.00000-of-00001.json").open("a") as f:
        f.write(json.dumps({"text": "one more"}) + "\n")
    more_tok, more = build()
    assert more_tok.encoded >= 301 and len(list(cache.iterdir())) == 3
    assert len(more.train.document_lengths()) == 301
