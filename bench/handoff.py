"""``scripts/bench handoff``: what the file route costs and what it buys, measured side by side.

Part 1, per prompt size (about 256, 1024 and 2048 tokens): the provider's prefill, its save, the
decoder's restore, the state file's size, the decoder's own prompt evaluation on each route, and the
time to first byte of the plain route (the decoder prefills) against the file route (through
onebitd: tokenize, provider prefill, save, restore, decode).  One unmeasured round first (each
side's first request pays for warming up), then ``--rounds`` rounds (6) in ABBA order: plain first
in the even rounds, the file route first in the odd ones; every prompt is new text of the same
length, so nothing is cached anywhere.  Medians, and the spread of the rounds' ratios.

Part 2, decode isolation: one stream is decoding when a 2k-token prompt arrives; the stream's
longest gap between two tokens with that prompt on the plain route (the decoder prefills it between
the stream's tokens) against the file route (a provider on another core prefills it).  Decoder and
provider are pinned to different cores (``cpu_affinity``).  The rounds in ABBA order, new text
each round.

Part 3, share against file: on one decoder started with ``LLAMA_KV_SHARE=1`` (the patched build),
per prompt size, a prompt prefilled and saved in slot 1, then handed to slot 0 both ways: a restore
of the saved file (the file route's last step) against a share, supervisor.llama.share_worker's copy of
the file's rows into the lent region, and an adopt (the share route's last steps); the decoder
evaluating one prompt token after each is checked, and the greedy reply after the adopt against slot
1's own, answered from its cache of the same tokens (the fidelity reference: a fresh prefill splits
its batches differently, and greedy output depends on the split).

Figures are ratios between the two routes in the same run, on the same processes; the machine line
first, and last how much CPU other processes took during the run.
"""

from __future__ import annotations

import argparse
import array
import json
import mmap
import os
import socket
import statistics
import subprocess
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import trio

from bench import plot
from bench.rig import Noise, Rig, machine, open_rig
from bench.workloads import first_byte_ms, longest_gap, prompt_of
from supervisor import config as configuration
from supervisor.config import Config, locate
from supervisor.llama.region import StateRows, write_rows
from supervisor.testing import unix_transport

ROOT = Path(__file__).resolve().parent.parent

TIMEOUT_S = 600  # one 2k-token prefill on a loaded 2-core machine is seconds, not minutes
SIZES = (256, 1024, 2048)


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=6, help="measured rounds per size, in ABBA order (6)")
    parser.add_argument("--quick", action="store_true", help="one round, 256 and 1024 tokens, a short stream")


def handoff_config(runtime_dir: Path) -> Config:
    cpus = sorted(os.sched_getaffinity(0))
    decoder_cpus, provider_cpus = ([cpus[0]], [cpus[1]]) if len(cpus) >= 2 else (cpus, cpus)
    data = configuration.unstructure(Config())
    data["server"].update(port=0, runtime_dir=str(runtime_dir), shutdown_grace_s=10.0)
    data["cache"]["dir"] = str(runtime_dir / "prefix")  # never the user's own store
    # Two slots of 4096 tokens: a 2048-token prompt and its reply fit one.
    data["model"].update(parallel=2, ctx_size=8192)
    data["decoder"].update(threads=len(decoder_cpus), cpu_affinity=decoder_cpus)
    # The file route forced: this benchmark measures the handoff's cost, not the route chooser.
    data["hybrid"].update(enabled=True, min_prompt_tokens=64, route_by="length")
    data["provider"] = [
        {"kind": "llama-server", "name": "bench", "threads": len(provider_cpus), "cpu_affinity": provider_cpus}
    ]
    config = configuration.structure(data, "bench")
    configuration.check(config, "bench")
    return config


async def direct_handoff(rig: Rig, prompt: str, slot: int, name: str) -> dict[str, float]:
    """The file route's steps by hand, to time save and restore apart from the rest."""
    tokens = (await rig.decoder.post("/tokenize", json={"content": prompt, "add_special": True})).json()["tokens"]
    done = (await rig.provider.post("/completion", json={"prompt": tokens, "n_predict": 0, "id_slot": 0})).json()
    saved = (await rig.provider.post("/slots/0?action=save", json={"filename": name})).json()
    restored = (await rig.decoder.post(f"/slots/{slot}?action=restore", json={"filename": name})).json()
    (rig.daemon.models.default.parts.state_dir / name).unlink(missing_ok=True)
    await rig.decoder.post(f"/slots/{slot}?action=erase", json={})
    return {
        "prefill_ms": done["timings"]["prompt_ms"],
        "save_ms": saved["timings"]["save_ms"],
        "restore_ms": restored["timings"]["restore_ms"],
        "bytes": saved["n_written"],
    }


async def one_round(rig: Rig, size: int, r: int) -> dict[str, Any]:
    """One round at ``size``: plain and the file route in ABBA order, then the file route's steps by
    hand; three new texts of the same length (``r`` -1 is the unmeasured warm-up round)."""
    salt = size * 1000 + (r + 1) * 3
    got: dict[str, Any] = {}

    async def plain() -> None:
        prompt, got["tokens"] = await prompt_of(rig.decoder, size, salt=salt)
        body = {"prompt": prompt, "n_predict": 4, "temperature": 0, "stream": True, "cache_prompt": False}
        # Plain: the decoder prefills, no cache to help it.
        got["plain_ms"], timings = await first_byte_ms(rig.decoder, "/completion", {**body, "id_slot": 1})
        got["decoder_ms"], got["plain_n"] = timings["prompt_ms"], timings["prompt_n"]

    async def hybrid() -> None:
        prompt, _ = await prompt_of(rig.decoder, size, salt=salt + 1)
        body = {"prompt": prompt, "n_predict": 4, "temperature": 0, "stream": True}
        got["file_ms"], timings = await first_byte_ms(rig.front, "/completion", body)
        got["hybrid_n"] = timings["prompt_n"]

    for side in (plain, hybrid) if r % 2 == 0 else (hybrid, plain):
        await side()
    prompt, _ = await prompt_of(rig.decoder, size, salt=salt + 2)
    got["steps"] = await direct_handoff(rig, prompt, slot=1, name=f"bench-{size}-{r + 1}.state")
    return got


async def sizes(rig: Rig, rounds: int, chosen: tuple[int, ...]) -> list[dict[str, Any]]:
    rows = []
    for size in chosen:
        await one_round(rig, size, -1)  # warm-up, unmeasured
        measured = [await one_round(rig, size, r) for r in range(rounds)]
        steps = [m["steps"] for m in measured]
        median = statistics.median
        shares = [(s["save_ms"] + s["restore_ms"]) / m["decoder_ms"] for s, m in zip(steps, measured, strict=True)]
        rows.append(
            {
                "tokens": measured[0]["tokens"],
                "provider_prefill_ms": median(s["prefill_ms"] for s in steps),
                "save_ms": median(s["save_ms"] for s in steps),
                "restore_ms": median(s["restore_ms"] for s in steps),
                "state_bytes": int(median(s["bytes"] for s in steps)),
                "decoder_prefill_ms": median(m["decoder_ms"] for m in measured),
                "plain_prompt_n": int(median(m["plain_n"] for m in measured)),
                "hybrid_prompt_n": int(median(m["hybrid_n"] for m in measured)),
                "plain_first_byte_ms": median(m["plain_ms"] for m in measured),
                "hybrid_first_byte_ms": median(m["file_ms"] for m in measured),
                "share": median(shares),
                "share_spread": (min(shares), max(shares)),
                "samples": {
                    "plain": [m["plain_ms"] for m in measured],
                    "file": [m["file_ms"] for m in measured],
                    "steps": steps,
                    "decoder": [m["decoder_ms"] for m in measured],
                },
            }
        )
    return rows


@asynccontextmanager
async def open_sharing_decoder(tmp: Path) -> AsyncIterator[httpx.AsyncClient]:
    """A patched llama-server with its share switch on: two slots of 4096 tokens."""
    config = Config()
    model = locate.model_path(config.model.path)
    binary = locate.llama_server("")
    if model is None or binary is None:
        raise RuntimeError("no model or llama-server: run scripts/setup first")
    sock = tmp / "share-decoder.sock"
    argv = [str(binary), "-m", str(model), "-c", "8192", "-np", "2", "-t", "1", "--host", str(sock)]
    process = await trio.lowlevel.open_process(
        [*argv, "--slot-save-path", f"{tmp}/", "--no-webui"],
        env={**os.environ, "LLAMA_KV_SHARE": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        transport = unix_transport(sock)
        async with httpx.AsyncClient(transport=transport, base_url="http://d", timeout=TIMEOUT_S) as client:
            with trio.fail_after(TIMEOUT_S):
                while True:  # the server loading its model in its own process: poll its health
                    try:
                        if (await client.get("/health")).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    if process.poll() is not None:
                        raise RuntimeError("the sharing llama-server exited")
                    await trio.sleep(0.05)
            yield client
    finally:
        process.kill()
        await process.wait()


async def share_against_file(tmp: Path, rounds: int, chosen: tuple[int, ...]) -> list[dict[str, Any]]:
    rows = []
    async with open_sharing_decoder(tmp) as decoder:
        for size in chosen:
            measured: list[dict[str, Any]] = []
            count = 0
            for r in range(rounds):
                prompt, count = await prompt_of(decoder, size, salt=9000 + size + r)
                tokens = (await decoder.post("/tokenize", json={"content": prompt, "add_special": True})).json()[
                    "tokens"
                ]
                await decoder.post("/completion", json={"prompt": tokens, "n_predict": 0, "id_slot": 1})
                name = f"bench-share-{size}-{r}.state"
                await decoder.post("/slots/1?action=save", json={"filename": name})
                state_path = tmp / name
                restored = (await decoder.post("/slots/0?action=restore", json={"filename": name})).json()
                after_restore = (
                    await decoder.post("/completion", json={"prompt": tokens, "n_predict": 1, "id_slot": 0})
                ).json()
                await decoder.post("/slots/0?action=erase", json={})
                path = tmp / "share.sock"
                path.unlink(missing_ok=True)
                with trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
                    await listener.bind(str(path))
                    listener.listen(1)
                    shared = (
                        await decoder.post("/slots/0?action=share", json={"socket": str(path), "n_tokens": len(tokens)})
                    ).json()
                    conn, _ = await listener.accept()
                    with conn:
                        raw, ancdata, _flags, _addr = await conn.recvmsg(1 << 20, socket.CMSG_SPACE(64))
                fds = array.array("i")
                fds.frombytes(ancdata[0][2])
                header = json.loads(raw[4 : 4 + int.from_bytes(raw[:4], "big")])
                region = mmap.mmap(fds[0], header["regions"][0]["size"])
                try:
                    start = trio.current_time()
                    written = write_rows(StateRows(state_path.read_bytes()), header, [region], len(tokens))
                    write_ms = (trio.current_time() - start) * 1000
                finally:
                    region.close()
                    os.close(fds[0])
                    state_path.unlink(missing_ok=True)
                assert written.n_tokens == len(tokens)
                adopted = (
                    await decoder.post(
                        "/slots/0?action=adopt",
                        json={"share_id": shared["share_id"], "n_tokens": len(tokens), "tokens": tokens},
                    )
                ).json()
                body = {"prompt": tokens, "n_predict": 8, "temperature": 0}
                after_adopt = (await decoder.post("/completion", json={**body, "id_slot": 0})).json()
                # The fidelity reference: the same decoder answering from its own cache for the same
                # tokens (slot 1 still holds them), not a fresh prefill, whose batch split differs.
                cached = (await decoder.post("/completion", json={**body, "id_slot": 1})).json()
                measured.append(
                    {
                        "restore_ms": restored["timings"]["restore_ms"],
                        "share_ms": shared["t_ms"],
                        "write_ms": write_ms,
                        "adopt_ms": adopted["t_ms"],
                        "restore_prompt_n": after_restore["timings"]["prompt_n"],
                        "adopt_prompt_n": after_adopt["timings"]["prompt_n"],
                        "same": after_adopt["content"] == cached["content"],
                    }
                )
            median = statistics.median
            rows.append(
                {
                    "tokens": count,
                    **{k: median(m[k] for m in measured) for k in ("restore_ms", "share_ms", "write_ms", "adopt_ms")},
                    "restore_prompt_n": max(m["restore_prompt_n"] for m in measured),
                    "adopt_prompt_n": max(m["adopt_prompt_n"] for m in measured),
                    "same": all(m["same"] for m in measured),
                }
            )
    return rows


async def run(args: argparse.Namespace) -> int:
    chosen = (256, 1024) if args.quick else SIZES
    rounds = 1 if args.quick else args.rounds
    stream_tokens = 64 if args.quick else 160
    print(
        f"onebit handoff: {rounds} round(s) per size after an unmeasured one, plain and the file route in ABBA "
        "order, new text every request"
    )
    print(machine())
    noise = Noise.start([])  # this process's tree: onebitd and every llama-server
    with tempfile.TemporaryDirectory(prefix="ob-bench-", dir="/tmp") as tmp:
        config = handoff_config(Path(tmp))
        print(f"cpus: decoder {config.decoder.cpu_affinity}, provider {config.provider[0].cpu_affinity}")
        async with open_rig(config) as rig:
            rows = await sizes(rig, rounds, chosen)
            gaps: dict[str, list[float]] = {"plain route": [], "file route": []}
            await longest_gap(rig, rig.decoder, rig.front, False, stream_tokens, -1)  # warm-up, unmeasured
            for r in range(rounds):
                # The stream goes straight to the decoder both times; only the intruder's route differs.
                for plain in (True, False) if r % 2 == 0 else (False, True):
                    intruder = rig.decoder if plain else rig.front
                    gaps["plain route" if plain else "file route"].append(
                        await longest_gap(rig, rig.decoder, intruder, plain, stream_tokens, r)
                    )
    print()
    print("prompt  provider   save   restore  state    decoder   decoder prompt_n  first byte ms     (save+restore)")
    print("tokens  prefill    ms     ms       MiB      prefill   plain  hybrid     plain   hybrid    / decoder prefill")
    for row in rows:
        low, high = row["share_spread"]
        print(
            f"{row['tokens']:>6}  {row['provider_prefill_ms']:>7.1f}  {row['save_ms']:>6.2f}  {row['restore_ms']:>6.2f}"
            f"  {row['state_bytes'] / 2**20:>7.2f}  {row['decoder_prefill_ms']:>7.1f}  {row['plain_prompt_n']:>6}"
            f"  {row['hybrid_prompt_n']:>6}  {row['plain_first_byte_ms']:>8.1f} {row['hybrid_first_byte_ms']:>8.1f}"
            f"    {row['share']:>6.2%} ({low:.2%} to {high:.2%})"
        )
    print()
    print("decode isolation: a stream's longest inter-token gap while a 2k-token prompt arrives (median of the rounds)")
    for route, measured in gaps.items():
        print(f"  {route:<12} {statistics.median(measured):8.1f} ms   ({min(measured):.1f} to {max(measured):.1f})")
    print(f"  ratio file/plain: {statistics.median(gaps['file route']) / statistics.median(gaps['plain route']):.3f}")
    with tempfile.TemporaryDirectory(prefix="ob-bench-", dir="/tmp") as tmp:
        shares = await share_against_file(Path(tmp), rounds, chosen)
    print()
    print("share against file, the last steps of each handoff on one decoder (LLAMA_KV_SHARE=1)")
    print("prompt  restore   share    worker   adopt    adopt/    prompt_n after  reply after adopt")
    print("tokens  ms        ms       write ms ms       restore   restore adopt   = cached reply")
    for row in shares:
        print(
            f"{row['tokens']:>6}  {row['restore_ms']:>7.2f}  {row['share_ms']:>7.3f}  {row['write_ms']:>7.1f}"
            f"  {row['adopt_ms']:>6.3f}  {row['adopt_ms'] / row['restore_ms']:>7.2%}  {row['restore_prompt_n']:>6}"
            f"  {row['adopt_prompt_n']:>5}   {'yes' if row['same'] else 'NO'}"
        )
    print(noise.report([]))
    if args.plot:
        figures = handoff_figures(rows, gaps, shares)
        plot.write(args.plot, "scripts/bench handoff", figures, quick=args.quick)
    return 0


def handoff_figures(
    rows: list[dict[str, Any]], gaps: dict[str, list[float]], shares: list[dict[str, Any]]
) -> list[plot.Panel]:
    """First byte against prompt length per route; the file route's steps beside the decoder's own
    prefill; decode isolation; share against file."""
    first = {
        route: [(row["tokens"], ms) for row in rows for ms in row["samples"][key]]
        for route, key in (("plain route", "plain"), ("file route", "file"))
    }
    steps = {
        f"{row['tokens']} tokens": {
            "provider prefill": [s["prefill_ms"] for s in row["samples"]["steps"]],
            "save": [s["save_ms"] for s in row["samples"]["steps"]],
            "restore": [s["restore_ms"] for s in row["samples"]["steps"]],
            "decoder prefill (plain)": row["samples"]["decoder"],
        }
        for row in rows
    }
    last_steps = {
        f"{row['tokens']} tokens": {
            "restore (file)": [row["restore_ms"]],
            "share + worker write + adopt": [row["share_ms"] + row["write_ms"] + row["adopt_ms"]],
        }
        for row in shares
    }
    return [
        plot.XY("first byte against prompt length", "prompt tokens", "first byte, ms", first),
        plot.Bars("the file route's steps (medians)", "ms", steps, log_y=True),
        plot.Bars(
            "decode isolation: a stream's longest gap while a 2k-token prompt arrives",
            "ms",
            {"longest inter-token gap": gaps},
            log_y=True,  # the plain route's gap is the whole prefill, the file route's a token's
        ),
        plot.Bars("share against file: the handoff's last steps", "ms", last_steps, log_y=True),
    ]
