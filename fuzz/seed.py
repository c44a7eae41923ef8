#!/usr/bin/env python3
"""Writes the fuzz targets' seed corpora from the project's own files.

- decode_batch: every ZMQ payload vLLM's publisher sent, from
  crates/kv-core/tests/fixtures/vllm/zmq_messages.vllm-*.json (copied from vLLM's own output);
- topic: vLLM-shaped topics and a few near misses;
- config: the shipped configuration files (config/*.yaml);
- chat_input: small chats with and without template arguments and tools;
- picker_body: a request of each API the endpoint picker reads (completions, chat with content
  parts, embeddings, responses, conversations) and vLLM-shaped responses (JSON, an SSE stream);
- token_ids: `TokenIds` messages (packed, unpacked, both mixed, cut inside a varint), ids of
  every varint width, each behind a chunk-size byte.

Usage: python3 fuzz/seed.py  (from the project root or fuzz/); idempotent.
"""
import glob
import hashlib
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, "fuzz", "corpus")


def put(target, data):
    folder = os.path.join(CORPUS, target)
    os.makedirs(folder, exist_ok=True)
    name = hashlib.sha1(data).hexdigest()
    with open(os.path.join(folder, name), "wb") as f:
        f.write(data)


fixtures = os.path.join(ROOT, "crates", "kv-core", "tests", "fixtures", "vllm")
for path in sorted(glob.glob(os.path.join(fixtures, "zmq_messages.vllm-*.json"))):
    with open(path) as f:
        doc = json.load(f)
    for scenario in doc["scenarios"]:
        for message in scenario.get("messages", []):
            put("decode_batch", bytes.fromhex(message["frames_hex"][2]))
            put("topic", bytes.fromhex(message["frames_hex"][0]))

for topic in [
    "kv@10.0.0.7:8000@Qwen/Qwen3-8B",
    "kv@[fd00::7]:8000@meta-llama/Llama-3.1-8B-Instruct",
    "kv@vllm-0.vllm-headless:8000@org/model@v2",
    "kv@10.0.0.7:8000@",
    "kv@@model",
    "kv-events",
]:
    put("topic", topic.encode())

for path in sorted(glob.glob(os.path.join(ROOT, "config", "*.yaml"))):
    with open(path, "rb") as f:
        put("config", f.read())

for chat in [
    '\n\nsystem\nYou are helpful.\nuser\nHi',
    '{"enable_thinking": false}\n\nuser\nWhat is a KV cache?',
    '{}\n[{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]\nuser\nWeather?\nassistant\nSunny.',
    '{"enable_thinking": true}\n[]\nuser\n\u00e9\u00e8 \U0001F600',
]:
    put("chat_input", chat.encode())

for path, body in [
    ("/v1/completions", {"model": "m", "prompt": "hello", "cache_salt": "t"}),
    ("/v1/completions", {"model": "m", "prompt": [[1, 2, 3], [4]]}),
    ("/v1/chat/completions", {"model": "m", "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "look"},
                                     {"type": "image_url", "image_url": {"url": "data:x"}}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}],
        "tools": [{"type": "function"}], "chat_template_kwargs": {"enable_thinking": False}}),
    ("/v1/embeddings", {"model": "e", "input": ["a", "b"]}),
    ("/v1/responses", {"model": "m", "instructions": "i", "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "q"}]},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]}),
    ("/v1/conversations", {"model": "m", "items": [{"role": "user", "content": "x"}]}),
    ("", {"model": "m", "messages": [{"role": "user", "content": "no path"}]}),
]:
    put("picker_body", (path + "\napplication/json\n" + json.dumps(body)).encode())
put("picker_body", b"/v1/completions\napplication/json\n" + json.dumps(
    {"choices": [{"text": "x"}], "usage": {"prompt_tokens": 40, "completion_tokens": 2,
     "prompt_tokens_details": {"cached_tokens": 32}}}).encode())
put("picker_body", b"/v1/chat/completions\ntext/event-stream\n"
    b'data: {"choices":[{"delta":{"content":"a"}}],"usage":null}\n\n'
    b'data: {"choices":[],"usage":{"prompt_tokens":40,"prompt_tokens_details":{"cached_tokens":32}}}\n\n'
    b"data: [DONE]\n\n")


def varint(v):
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def packed(ids):
    payload = b"".join(varint(i) for i in ids)
    return b"\x0a" + varint(len(payload)) + payload


def unpacked(ids):
    return b"".join(b"\x08" + varint(i) for i in ids)


widths = [0, 1, 127, 128, 16383, 16384, 151935, 2097151, 2097152, 2**28, 2**32 - 1]
prompt = [(i * 2654435761) % 151936 for i in range(600)]
for step, message in [
    (0, packed(widths)),
    (6, packed(prompt)),
    (2, unpacked(widths)),
    (11, packed(widths) + unpacked(prompt[:20]) + packed(prompt[20:40])),
    (3, packed(widths)[:-1]),
    (255, b"\x10\x05" + packed(widths[:4])),
    (1, b""),
]:
    put("token_ids", bytes([step]) + message)
