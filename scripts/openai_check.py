"""Check `ferrite serve` with the official `openai` Python client (run by scripts/openai-check.sh).

Usage: python openai_check.py BASE_URL API_KEY
"""
import sys

import openai

base, key = sys.argv[1], sys.argv[2]
c = openai.OpenAI(base_url=base, api_key=key, max_retries=0)
model = c.models.list().data[0].id

r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hi"}], max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
text = r.choices[0].message.content
assert r.choices[0].finish_reason in ("stop", "length"), r
assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens, r.usage
assert len(r.choices[0].logprobs.content) == r.usage.completion_tokens, r.choices[0].logprobs
assert all(len(e.top_logprobs) == 2 for e in r.choices[0].logprobs.content)

parts, usage = [], None
for chunk in c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hi"}], max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True}):
    if chunk.choices and chunk.choices[0].delta.content:
        parts.append(chunk.choices[0].delta.content)
    if chunk.usage:
        usage = chunk.usage
assert "".join(parts) == text, ("".join(parts), text)
assert usage is not None and usage.completion_tokens == r.usage.completion_tokens, usage

r = c.completions.create(model=model, prompt="The capital of France is", max_tokens=5, temperature=0, stop=["."])
assert r.choices[0].finish_reason in ("stop", "length") and "." not in r.choices[0].text, r

try:
    c.completions.create(model=model, prompt="x", temperature=5)
    raise AssertionError("temperature 5 was accepted")
except openai.BadRequestError as e:
    assert "temperature" in e.message, e.message
try:
    openai.OpenAI(base_url=base, api_key="wrong", max_retries=0).models.list()
    raise AssertionError("a wrong API key was accepted")
except openai.AuthenticationError:
    pass
print(f"openai {openai.__version__} client: chat, streamed chat, completions, 400 and 401 all as expected")
