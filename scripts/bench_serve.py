#!/usr/bin/env python3
"""Load benchmark for `ferrite serve` (standard library only).

Throughput mode (default): for each concurrency level C, C client threads each send streamed
completions back to back until R requests are done. Every request generates exactly
--max-tokens tokens (`ignore_eos`). Reports aggregate generated tokens/s, time to first token
(TTFT) and time per output token (TPOT = (last token - first token) / (tokens - 1)) per request,
and the inter-token latency (ITL: every gap between two streamed chunks of a request).

With --long-every K, every K-th request has a long prompt (--long-words), so TPOT shows how much
the chunked prefill of long prompts delays the other streams' decoding (see --max-batch-tokens).

Prefix mode (--prefix): sequential chat requests that share a long system prompt and differ in
the user message; reports the TTFT of the first (cold) request and of the later ones, which can
take the system prompt's KV blocks from the prefix cache (compare a server started with
--no-prefix-cache).

Usage:
  target/release/ferrite serve --port 8080 &
  scripts/bench_serve.py --url http://127.0.0.1:8080 --streams 1,8 --requests 16 --max-tokens 64
  scripts/bench_serve.py --url http://127.0.0.1:8080 --prefix
"""
import argparse
import json
import statistics
import threading
import time
import urllib.request


def percentile(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def post_stream(url, body, key):
    """Send a streamed request; return (TTFT s, token arrival times, usage)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    if key:
        req.add_header("Authorization", "Bearer " + key)
    t0 = time.perf_counter()
    times, usage = [], None
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices", []):
                text = c.get("text") if "text" in c else c.get("delta", {}).get("content")
                if text:
                    times.append(time.perf_counter() - t0)
    return times, usage


def throughput(args, streams):
    url = args.url + "/v1/completions"
    lock = threading.Lock()
    state = {"next": 0, "results": [], "gaps": []}

    def worker():
        while True:
            with lock:
                i = state["next"]
                if i >= args.requests:
                    return
                state["next"] += 1
            prompt = f"Request {i}: " + args.prompt
            if args.long_every and i % args.long_every == args.long_every - 1:
                # A long prompt: its prefill runs in chunks while the other streams decode.
                prompt = f"Request {i}: " + " ".join(f"item {k}," for k in range(args.long_words // 2)) + " " + args.prompt
            body = {
                "prompt": prompt,
                "max_tokens": args.max_tokens,
                "temperature": args.temperature,
                **({"logprobs": args.logprobs} if args.logprobs is not None else {}),
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            times, usage = post_stream(url, body, args.api_key)
            n = usage["completion_tokens"]
            tpot = (times[-1] - times[0]) / (n - 1) if n > 1 and len(times) > 1 else float("nan")
            gaps = [b - a for a, b in zip(times, times[1:])]
            with lock:
                state["results"].append((times[0], tpot, n))
                state["gaps"].extend(gaps)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    res = state["results"]
    tokens = sum(r[2] for r in res)
    ttft = [r[0] for r in res]
    tpot = [r[1] for r in res]
    return {
        "streams": streams,
        "requests": len(res),
        "tokens": tokens,
        "wall": wall,
        "tps": tokens / wall,
        "ttft_p50": percentile(ttft, 0.5),
        "ttft_p99": percentile(ttft, 0.99),
        "tpot_p50": percentile(tpot, 0.5),
        "tpot_p99": percentile(tpot, 0.99),
        "itl_p99": percentile(state["gaps"], 0.99),
        "itl_max": max(state["gaps"], default=float("nan")),
    }


def prefix(args):
    url = args.url + "/v1/chat/completions"
    system = "You are a helpful assistant for a travel agency. " + " ".join(
        f"Rule {i}: always answer politely, mention the price in euros and keep answers short." for i in range(args.prefix_rules)
    )
    ttfts = []
    for i in range(args.requests):
        body = {
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"Question {i}: where should I travel in month {i % 12 + 1}?"}],
            "max_tokens": 4,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        times, usage = post_stream(url, body, args.api_key)
        ttfts.append((times[0] if times else float("nan"), usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]))
    cold = ttfts[0]
    warm = ttfts[1:]
    print(f"prompt tokens: {cold[1]}; cold TTFT {cold[0]*1e3:.0f} ms (cached {cold[2]})")
    print(
        f"warm TTFT: median {statistics.median(t[0] for t in warm)*1e3:.0f} ms over {len(warm)} requests "
        f"(cached tokens: median {statistics.median(t[2] for t in warm):.0f})"
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--api-key")
    ap.add_argument("--streams", default="1,8", help="comma-separated concurrency levels")
    ap.add_argument("--requests", type=int, default=16, help="requests per level")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of the throughput requests (0: greedy; above 0 the server's sampling chain runs, top-k 40 by default)")
    ap.add_argument("--logprobs", type=int, help="ask for this many top log-probabilities per token")
    ap.add_argument("--prompt", default="Write a short story about a lighthouse keeper and a storm.")
    ap.add_argument("--long-every", type=int, default=0, help="every K-th request gets a long prompt (0: none)")
    ap.add_argument("--long-words", type=int, default=600, help="length of the long prompts in words")
    ap.add_argument("--prefix", action="store_true", help="measure TTFT with a shared system prompt")
    ap.add_argument("--prefix-rules", type=int, default=20, help="length of the shared system prompt")
    args = ap.parse_args()
    if args.prefix:
        prefix(args)
        return
    rows = [throughput(args, int(s)) for s in args.streams.split(",")]
    print("| streams | requests | tokens | wall s | aggregate tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | ITL p99 / max ms |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['streams']} | {r['requests']} | {r['tokens']} | {r['wall']:.1f} | {r['tps']:.1f} | "
            f"{r['ttft_p50']*1e3:.0f} / {r['ttft_p99']*1e3:.0f} | {r['tpot_p50']*1e3:.1f} / {r['tpot_p99']*1e3:.1f} | "
            f"{r['itl_p99']*1e3:.0f} / {r['itl_max']*1e3:.0f} |"
        )


if __name__ == "__main__":
    main()
