"""The per-request KV memory table of docs/serving.md ("KV memory"), from the formula (``macer.core.kv_memory``).

    python -m benchmarks.kv_memory_table            # Markdown on stdout

For the Qwen2.5-Omni thinkers at the paper's settings (7B: 28 layers, 4 KV heads of 128, stages after layers 3 and 5,
audio share 0.30; 3B: 36 layers, 2 KV heads of 128, stages after 4 and 7, audio share 0.32), bf16 K/V, vLLM's GPU
block size 16, a clip prompt plus a 256-token answer: the KV cache one request holds in vLLM's own model and with
MACER's compacted KV cache groups (the layer they start at, vLLM's grouping and its padding slots included), and the
ratio, which is how many more such requests fit in the same KV cache. Arithmetic only: no engine runs.
"""

from __future__ import annotations

from macer.core.kv_memory import compacted_start, kv_groups, request_pages, vanilla_pages
from macer.core.policies import make_policy

MODELS = {
    # name: (decoder layers, KV heads, head size, MACER settings (the paper's defaults))
    "7B": (28, 4, 128, {"audio_layer": 3, "video_layer": 5, "audio_share": 0.30}),
    "3B": (36, 2, 128, {"audio_layer": 4, "video_layer": 7, "audio_share": 0.32}),
}
CLIPS = {
    # name: (text, audio, video) rows of the prompt
    "paper clip (2.3k)": (24, 1460, 864),
    "10k clip": (40, 4000, 6000),
}
BLOCK, ANSWER, BYTES = 16, 256, 2  # vLLM's GPU block size, answer tokens, bf16


def rows() -> list[dict]:
    out = []
    for model, (layers, kv_heads, head, settings) in MODELS.items():
        page = BLOCK * 2 * kv_heads * head * BYTES  # one layer's K and V for one block
        for clip, (text, audio, video) in CLIPS.items():
            n = text + audio + video
            vanilla = vanilla_pages(n, layers, ANSWER, BLOCK) * page
            for keep in (0.25, 0.1):
                policy = make_policy("macer", keep_ratio=keep, end_of_turn_token_id=2, **settings)
                start = compacted_start(policy, layers)
                tokens = policy.layer_tokens(text, audio, video, layers)
                macer = request_pages(n, tokens, ANSWER, BLOCK, start) * page
                groups = kv_groups(layers, start)
                slots = max(map(len, groups)) * len(groups)
                out.append({"model": model, "clip": clip, "prompt": n, "keep": keep, "start": start,
                            "groups": f"{len(groups)} x {max(map(len, groups))} ({slots - layers} padding)",
                            "vanilla_mib": vanilla / 2**20, "macer_mib": macer / 2**20, "ratio": vanilla / macer})
    return out


def markdown(table: list[dict]) -> str:
    lines = ["| model | prompt | keep | compacted from layer | KV cache groups | vLLM's own (MiB) | MACER (MiB) | "
             "MACER / own | requests that fit |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        lines.append(f"| {r['model']} | {r['clip']}: {r['prompt']} tokens | {r['keep']} | {r['start']} | "
                     f"{r['groups']} | {r['vanilla_mib']:.0f} | {r['macer_mib']:.0f} | "
                     f"{1 / r['ratio']:.2f}x | {r['ratio']:.2f}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(rows()))
