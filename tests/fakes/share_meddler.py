"""supervisor.llama.share_worker with one fault injected, for the share route's fallback tests.

share_meddler.py MODE DECODER_SOCKET LLAMA_SERVER [llama-server model args]

use-slot  write the rows, then send the decoder a request pinned to the lent slot (the share is revoked)
reshare   write the rows, then take a new share of the same slot (onebitd's share_id is stale)
nothing   write nothing; claim 0 tokens
short     prefill and write one token fewer than the job has; claim what was written
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
from typing import Any

from supervisor.llama import share_worker


def main() -> int:
    mode, decoder, *rest = sys.argv[1:]
    honest = share_worker.Worker.share_job

    def share_job(self: share_worker.Worker, job: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        slot = job["layout"]["id_slot"]
        if mode == "nothing":
            return {"n_tokens": 0, "prefill_ms": 1.0}
        if mode == "short":
            return honest(self, {**job, "tokens": job["tokens"][:-1]}, fds)
        answer = honest(self, job, fds)
        if mode == "use-slot":
            status, _ = share_worker.call(
                decoder, "POST", "/completion", {"prompt": "Hello", "n_predict": 1, "id_slot": slot}
            )
            assert status == 200
        elif mode == "reshare":
            with tempfile.TemporaryDirectory(prefix="md-") as tmp, socket.socket(socket.AF_UNIX) as listener:
                path = os.path.join(tmp, "s.sock")
                listener.bind(path)
                listener.listen(1)
                status, _ = share_worker.call(
                    decoder, "POST", f"/slots/{slot}?action=share", {"socket": path, "n_tokens": 4}
                )
                assert status == 200
                conn, _ = listener.accept()
                conn.close()  # the fd that came with the header goes with it
        return answer

    share_worker.Worker.share_job = share_job  # type: ignore[method-assign]
    return share_worker.main(rest)


if __name__ == "__main__":
    sys.exit(main())
