"""The real `openai` SDK against a live `openglm serve`: models, completions, chat, streaming."""

import httpx


def test_models(client, server):

    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-test"]
    assert client.models.retrieve("tiny-test").id == "tiny-test"
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}


def test_completion(client):
    out = client.completions.create(model="tiny-test", prompt="def add(a, b):", max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert out.object == "text_completion" and choice.finish_reason == "length"
    assert out.usage.completion_tokens == 12 and out.usage.prompt_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12
    again = client.completions.create(model="tiny-test", prompt="def add(a, b):", max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert again.choices[0].text == choice.text  # greedy is deterministic


def test_completion_batch_prompts_n_and_logprobs(client):
    out = client.completions.create(model="tiny-test", prompt=["x = 1", "import json"], max_tokens=4, n=2,
                                    temperature=0.8, seed=5, logprobs=2, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for c in out.choices:
        assert len(c.logprobs.tokens) == 4 and len(c.logprobs.top_logprobs[0]) <= 2
        assert all(lp <= 0 for lp in c.logprobs.token_logprobs)
    assert out.usage.completion_tokens == 16


def test_chat(client):
    out = client.chat.completions.create(
        model="tiny-test", messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    choice = out.choices[0]
    assert out.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert out.usage.completion_tokens == len(choice.logprobs.content) <= 8
    assert isinstance(choice.message.content, str)


def test_chat_stream_with_usage_matches_non_stream(client):
    kw = dict(model="tiny-test", messages=[{"role": "user", "content": "count to three"}], max_tokens=16,
              temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_stream(client):
    kw = dict(model="tiny-test", prompt="for i in range(3):", max_tokens=10, temperature=0,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    stream = client.completions.create(stream=True, **kw)
    pieces = [c.choices[0].text for c in stream if c.choices]
    assert "".join(pieces) == full and len(pieces) > 1


def test_stop_sequence_over_http(client):
    kw = dict(model="tiny-test", prompt="while x:", max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    stop = full[8:10]
    cut = client.completions.create(stop=[stop], **kw).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[: full.index(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(stop=[stop], stream=True, **kw)
                       if c.choices)
    assert streamed == cut.text  # the held-back tail never leaks the stop string
