"""Tokenization as vLLM does it (BOS for completions, chat template then no extra specials), the
engine-load parser, and request parsing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from kvstrata.router.loadscrape import parse_load
from kvstrata.router.prompts import (
    ChatTemplateError,
    LocalTokenizer,
    TokenizerLoadError,
    chat_template_kwargs,
)
from kvstrata.router.requests import BadRequest, ParsedRequest, parse_request

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@pytest.fixture
def tok_dir(tmp_path: Path) -> Path:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    words = ["hello", "world", "<|user|>", "<|assistant|>", "<|system|>", "hi", "there"]
    vocab.update({w: i + 3 for i, w in enumerate(words)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.add_special_tokens(["<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    cfg = {"bos_token": {"content": "<s>"}, "eos_token": "</s>", "chat_template": TEMPLATE}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_completion_gets_bos_once(tok_dir: Path) -> None:
    t = LocalTokenizer(tok_dir)
    assert t.encode_completion("hello world") == [1, 3, 4]


def test_fast_encode_gives_the_ids_of_encode(tmp_path: Path) -> None:
    """The router encodes without offsets (encode_batch_fast); the ids must equal what vLLM's encode gives."""
    from tokenizers import decoders, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [
        "The quick brown fox jumps over the lazy dog.",
        "Ünïcödé   spaces\tand\nnewlines",
        "x = f(y) + 42",
    ]
    tok.train_from_iterator(corpus * 20, trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>"]))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(str(tmp_path / "tokenizer.json"))
    t = LocalTokenizer(tmp_path)
    for text in [*corpus, "", " leading", "trailing  ", "<s> inside", "日本語のテキスト", "a" * 5000]:
        assert t.encode_completion(text) == tok.encode(text, add_special_tokens=True).ids
        assert t._ids(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False).ids


def test_chat_renders_template_and_adds_no_second_bos(tok_dir: Path) -> None:
    t = LocalTokenizer(tok_dir)
    msgs = [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}]
    assert t.render_chat(msgs) == "<s><|user|>\nhi\nthere\n<|assistant|>\n"
    assert t.encode_chat(msgs) == [1, 5, 8, 9, 6]
    assert t.encode_chat(msgs, add_generation_prompt=False) == [1, 5, 8, 9]


def test_template_kwargs_from_the_request() -> None:
    assert chat_template_kwargs({}) == {}
    assert chat_template_kwargs({"add_generation_prompt": False, "chat_template_kwargs": {"x": 1}}) == {
        "add_generation_prompt": False,
        "x": 1,
    }


def test_missing_or_broken_tokenizer_is_a_clear_error(tmp_path: Path, tok_dir: Path) -> None:
    with pytest.raises(TokenizerLoadError, match=r"tokenizer\.json not found"):
        LocalTokenizer(tmp_path / "nothing")
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for %}"}))
    with pytest.raises(ChatTemplateError, match="does not compile"):
        LocalTokenizer(tok_dir)
    (tok_dir / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ChatTemplateError, match="no chat template"):
        LocalTokenizer(tok_dir).encode_chat([{"role": "user", "content": "hi"}])


def test_template_raise_exception_is_a_chat_template_error(tok_dir: Path) -> None:
    cfg = {"chat_template": "{{ raise_exception('roles must alternate') }}"}
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        LocalTokenizer(tok_dir).render_chat([{"role": "user", "content": "x"}])


def test_parse_load_from_recorded_metrics(metrics_text: str) -> None:
    load = parse_load(metrics_text)
    assert (load.running, load.waiting, load.kv_usage) == (0.0, 0.0, 0.0)
    busy = metrics_text.replace(
        'vllm:num_requests_running{engine="0",model_name="tiny"} 0.0',
        'vllm:num_requests_running{engine="0",model_name="tiny"} 3.0',
    )
    busy += 'vllm:num_requests_running{engine="1",model_name="tiny"} 2.0\nvllm:num_requests_waiting{engine="1",model_name="tiny"} 4.0\n'
    busy += 'vllm:kv_cache_usage_perc{engine="1",model_name="tiny"} 0.75\n'
    assert (
        parse_load(busy).running == 5.0
        and parse_load(busy).waiting == 4.0
        and parse_load(busy).kv_usage == 0.75
    )
    assert parse_load("garbage\nvllm:num_requests_waiting{x} notanumber\n").waiting == 0.0


def test_parse_request_shapes() -> None:
    p = parse_request(b'{"model":"m","prompt":[[1,2],[3]]}', "completion", "m")
    assert p.token_ids == [1, 2] and p.text is None
    p = parse_request(b'{"model":"m","prompt":["a","b"],"stream":null}', "completion", "m")
    assert p.text == "a" and p.stream is False
    p = parse_request(b'{"model":"m","messages":[{"role":"user","content":"x"}],"stream":true}', "chat", "m")
    assert p.stream and p.routing_text() == "user:x\n"
    with pytest.raises(BadRequest) as exc:
        parse_request(b'{"model":"m","prompt":[]}', "completion", "m")
    assert exc.value.status == 400 and exc.value.body()["error"]["param"] == "prompt"


def test_a_long_list_of_token_ids_is_checked_and_sized_in_slices() -> None:
    """Ids are checked a slice at a time (each C call holds the GIL) and sized without a call per id:
    the same answers as one pass, a non-int anywhere refused."""
    ids = list(range(100_000))
    p = parse_request(json.dumps({"model": "m", "prompt": ids}).encode(), "completion", "m")
    assert p.token_ids == ids and p.size == 4 * len(ids)
    for bad in (1.5, True, "7", None):
        for at in (0, 32_767, 32_768, 99_999):  # either side of a slice's edge, and the last
            prompt = [*ids[:at], bad, *ids[at + 1 :]]
            with pytest.raises(BadRequest) as exc:
                parse_request(json.dumps({"model": "m", "prompt": prompt}).encode(), "completion", "m")
            assert exc.value.body()["error"]["param"] == "prompt", (bad, at)
    p = parse_request(b'{"model":"m","prompt":[[1,2],[3]]}', "completion", "m")
    assert p.size == 12  # a batch of id lists: every id counts


async def test_short_prompts_are_tokenized_inline_long_ones_in_the_pool(tok_dir: Path) -> None:
    """The thread hop costs more than encoding a short prompt; a long one must not hold the loop."""
    from kvstrata.api.router_config import RouterSettings
    from kvstrata.router.core import Router
    from kvstrata.router.hashing import block_hashes
    from kvstrata.router.metrics import RouterMetrics

    settings = RouterSettings.model_validate({"model": "m", "blockSize": 2, "remoteTokenize": False})
    tok = LocalTokenizer(tok_dir)
    offloaded: list[object] = []

    class Counting(Router):  # a subclass: a compiled router's methods cannot be replaced on an instance
        async def _offload(self, size: int, fn: Any, *args: Any) -> Any:
            offloaded.append(fn)
            return await super()._offload(size, fn, *args)

    router = Counting(settings, RouterMetrics(), tokenizer=tok)
    try:
        for words, pooled in ((3, 0), (400, 1)):  # 53 and 7,199 characters
            text = " ".join(["hello world there"] * words)
            req = ParsedRequest("completion", {}, "m", False, text=text)
            got = await router.prompt_hashes(req, [])
            ids = tok.encode_completion(text)
            # A cold long prompt is routed on its leading blocks; the rest is hashed on the background
            # thread (router/workpool.py), not on the loop either.
            n, hashes = (got.tokens, got.hashes) if got.rest is None else await got.rest
            assert (hashes, got.approximate, n) == (block_hashes(ids, 2), False, len(ids))
            assert len(offloaded) + (got.rest is not None) == pooled
    finally:
        router.close()
