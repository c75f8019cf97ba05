"""Stored Responses are bounded in bytes as well as in count and age.

A response's size is the JSON size of its conversation and its body; the
oldest go first when the total would pass the bound, and one larger than the
whole bound is not stored (its id is a 404 later, as an evicted one's).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from mlx_cairn.api.openai_responses import MAX_STORED_RESPONSE_BYTES, ResponseStore
from mlx_cairn.protocol.openai_responses import ResponseNotFound
from mlx_cairn.types import Message
from scripted_model import say
from test_openai_support import openai_env

#: Text the tiny tokenizer packs tightly (11 characters a token), so kilobytes fit the context.
FILL = " 0123456789"


def entry(text: str) -> tuple[list[Message], dict[str, Any]]:
    return [Message("user", text)], {"object": "response", "output": [], "metadata": {}}


def test_the_default_bound_is_256_mib() -> None:
    assert ResponseStore().max_bytes == MAX_STORED_RESPONSE_BYTES == 256 * 2**20
    with pytest.raises(ValueError):
        ResponseStore(max_bytes=0)


def test_oldest_go_first_when_the_bytes_run_out() -> None:
    one = ResponseStore()
    one.put("a", *entry("x" * 1000))
    size = one.nbytes
    assert 1000 < size < 1200
    store = ResponseStore(max_bytes=size * 3)
    for rid in "abc":
        store.put(rid, *entry("x" * 1000))
    assert len(store) == 3 and store.nbytes == 3 * size
    store.put("d", *entry("x" * 1000))  # one more: "a" goes
    with pytest.raises(ResponseNotFound, match="MiB"):
        store.get("a")
    assert [store.get(r).body["object"] for r in "bcd"] == ["response"] * 3
    store.put("e", *entry("x" * 1500))  # larger: "b" and "c" go
    assert len(store) == 2 and store.nbytes <= store.max_bytes
    for rid in "bc":
        with pytest.raises(ResponseNotFound):
            store.get(rid)
    store.delete("d")
    assert len(store) == 1 and store.nbytes == store.get("e").size


def test_a_response_larger_than_the_bound_is_not_stored_and_evicts_nothing() -> None:
    store = ResponseStore(max_bytes=5000)
    store.put("small", *entry("x" * 100))
    kept = store.nbytes
    store.put("huge", *entry("x" * 6000))
    with pytest.raises(ResponseNotFound):
        store.get("huge")
    assert store.get("small") and store.nbytes == kept


def test_expiry_and_replacing_an_id_keep_the_count_right() -> None:
    now = [0.0]
    store = ResponseStore(ttl_s=10, clock=lambda: now[0], max_bytes=10_000)
    store.put("a", *entry("x" * 100))
    store.put("a", *entry("x" * 200))  # the same id again: counted once
    assert len(store) == 1 and store.nbytes == store.get("a").size
    now[0] = 11
    assert len(store) == 0 and store.nbytes == 0


@pytest.fixture(scope="module")
def env() -> Iterator[dict[str, Any]]:
    with openai_env() as e:
        yield e


def test_over_the_byte_bound_through_the_api(env: dict[str, Any]) -> None:
    app, c = env["app"], env["client"]
    stores = app.state.cairn.dialect_state
    saved = stores.get("openai_responses")
    stores["openai_responses"] = store = ResponseStore(max_bytes=20_000)
    try:
        big = c.responses.create(model="scripted", input=say("fine") + FILL * 3_000)
        assert big.status == "completed" and big.output_text == "fine"  # the answer is as ever
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(big.id)
        with pytest.raises(openai.NotFoundError) as nf:
            c.responses.create(model="scripted", input="x", previous_response_id=big.id)
        assert nf.value.body["param"] == "previous_response_id"  # type: ignore[index]
        assert len(store) == 0

        first = c.responses.create(model="scripted", input=say("one") + FILL * 700)
        second = c.responses.create(model="scripted", input=say("two") + FILL * 700)
        assert c.responses.retrieve(first.id).id == first.id
        third = c.responses.create(model="scripted", input=say("three") + FILL * 700)
        with pytest.raises(openai.NotFoundError):  # evicted, oldest first, to fit 20 kB
            c.responses.retrieve(first.id)
        assert {c.responses.retrieve(r.id).id for r in (second, third)} == {second.id, third.id}
        assert store.nbytes <= 20_000
    finally:
        stores["openai_responses"] = saved
