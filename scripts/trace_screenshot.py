"""Profile one real training step of the demo's pipeline and draw its cross-worker trace.

    .venv/bin/python scripts/trace_screenshot.py docs/images/trace.png

Starts three local workers, runs one step of ``distgrad demo``'s pipeline layout (warm-up steps
first) under ``distgrad.profiler.profile()``, exports the Chrome/Perfetto trace next to the
image (``.json``), and renders the trace as a timeline: one track per worker, RPC ranges and the
callee's handling of each, flow arrows between them. Pillow draws it (``pip install pillow``;
a maintainer tool, not a dependency). The JSON opens in https://ui.perfetto.dev as well.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import socket
import sys
from pathlib import Path
from typing import Any

_COLORS = {
    "rpc": (66, 133, 244),
    "rpc.serve": (52, 168, 83),
    "backward": (234, 67, 53),
    "cpu_op": (160, 160, 160),
}


def _worker(rank: int, port: int, out: str) -> None:
    import torch

    import distgrad.profiler
    import distgrad.rpc as rpc
    from distgrad._demo import _work

    torch.set_num_threads(1)
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=3, rpc_backend_options=options)
    if rank == 0:
        x, y, _, _ = _work.load_digits(0)
        trainer = _work.PipelineTrainer(["worker1", "worker2"], 0, 0.05, 2)
        for _ in range(5):  # warm up (first calls import and allocate)
            trainer.step(x[:32], y[:32])
        with distgrad.profiler.profile() as prof:
            trainer.step(x[32:64], y[32:64])
        prof.export_chrome_trace(out)
    rpc.shutdown()


def _slices(trace: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[int, str]]:
    names = {
        e["pid"]: e["args"]["name"]
        for e in trace["traceEvents"]
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    slices = [
        e
        for e in trace["traceEvents"]
        if (e.get("ph") == "X" and e.get("cat") in ("rpc", "rpc.serve")) or _is_backward(e)
    ]
    return slices, names


def _is_backward(event: dict[str, Any]) -> bool:
    name = str(event.get("name", ""))
    return event.get("ph") == "X" and ("Backward" in name or "backward" in name)


def render(trace_path: Path, image_path: Path) -> None:
    from PIL import Image, ImageDraw, ImageFont

    trace = json.loads(trace_path.read_text())
    slices, names = _slices(trace)
    flows = [e for e in trace["traceEvents"] if e.get("ph") in ("s", "f")]
    start = min(e["ts"] for e in slices)
    end = max(e["ts"] + e["dur"] for e in slices)
    width, margin, track_h, row_h = 1600, 110, 150, 15
    pids = sorted(names)
    height = 60 + track_h * len(pids) + 40
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.truetype("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf", 12)
    bold = ImageFont.truetype("/usr/share/fonts/truetype/dejavu/DejaVuSans-Bold.ttf", 14)
    scale = (width - margin - 20) / (end - start)

    def x_of(ts: float) -> float:
        return margin + (ts - start) * scale

    title = (
        f"distgrad: one pipeline training step ({(end - start) / 1000:.1f} ms, profiled). "
        "Blue: an RPC as its caller sees it; green: its handling on the callee; "
        "red: backward ops; lines: the messages"
    )
    draw.text((10, 10), title, fill="black", font=bold)
    rows: dict[tuple[int, int], float] = {}
    anchor: dict[tuple[int, float], tuple[float, float]] = {}
    for pid_index, pid in enumerate(pids):
        top = 50 + pid_index * track_h
        draw.rectangle((0, top, width, top + track_h - 6), fill=(246, 246, 246))
        draw.text((10, top + 8), names[pid], fill="black", font=bold)
        events = sorted((e for e in slices if e["pid"] == pid), key=lambda e: (e["ts"], -e["dur"]))
        for event in events:
            depth = 0
            while rows.get((pid, depth), -1.0) > event["ts"]:
                depth += 1
            rows[(pid, depth)] = event["ts"] + event["dur"]
            if depth > 7:
                continue
            y0 = top + 30 + depth * row_h
            x0 = x_of(event["ts"])
            x1 = max(x_of(event["ts"] + event["dur"]), x0 + 2)
            kind = event.get("cat", "cpu_op")
            if _is_backward(event) and kind == "cpu_op":
                kind = "backward"
            draw.rectangle((x0, y0, x1, y0 + row_h - 3), fill=_COLORS.get(kind, (160, 160, 160)))
            label = str(event["name"]).split("#")[-1].split("(")[0][:40]
            if x1 - x0 > 7 * len(label):
                draw.text((x0 + 2, y0), label, fill="white", font=font)
            anchor[(pid, event["ts"])] = (x0, y0 + row_h / 2)
    by_id: dict[Any, list[dict[str, Any]]] = {}
    for flow in flows:
        by_id.setdefault(flow["id"], []).append(flow)
    for pair in by_id.values():
        src = next((f for f in pair if f["ph"] == "s"), None)
        dst = next((f for f in pair if f["ph"] == "f"), None)
        if src is None or dst is None:
            continue
        y_src = 50 + pids.index(src["pid"]) * track_h + 36
        y_dst = 50 + pids.index(dst["pid"]) * track_h + 36
        draw.line((x_of(src["ts"]), y_src, x_of(dst["ts"]), y_dst), fill=(90, 90, 90), width=1)
    ticks = 10
    for i in range(ticks + 1):
        ts = start + (end - start) * i / ticks
        draw.line((x_of(ts), height - 35, x_of(ts), height - 28), fill="black")
        draw.text((x_of(ts) - 12, height - 25), f"{(ts - start) / 1000:.1f} ms", fill="black",
                  font=font)  # fmt: skip
    image_path.parent.mkdir(parents=True, exist_ok=True)
    image.save(image_path)


def main() -> int:
    image_path = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/images/trace.png")
    trace_path = image_path.with_suffix(".json")
    image_path.parent.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, port, str(trace_path))) for r in range(3)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(300)
        if proc.is_alive():
            proc.kill()
    if any(p.exitcode != 0 for p in procs):
        print("a worker failed", file=sys.stderr)
        return 1
    render(trace_path, image_path)
    print(f"wrote {trace_path} and {image_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
