"""One fake llama-server: a core and two thin adapters.

core        what it answers to a method, path and body, and its slots' state (no I/O, no waiting):
            an answer is a generator of steps (pause, head, chunk, whole reply, an effect after it)
completion  the completions: parsing a request into a job, the flow of one, the reply shapes
slots       the slot actions (save, restore, erase, share, adopt)
share       a slot's KV lent as memfds: the regions, the rows a provider writes, the header sent
inprocess   the core as an httpx handler and the decoder client's transport (no process)
process     the core as a program started like llama-server, for what only a process shows
            (crashes, restarts, signals, fd passing): ``python -m tests.fakes.llama.process``

The two adapters differ only in how they wait and speak HTTP: the in-process one waits on a trio
event (``release``) where a step pauses, and keeps what it was asked; the program polls its modes
(tests/fakes/fake_control.py) and logs what it did beside the control file.
"""

# The completions and the slot actions register their endpoints in core's table as they are imported.
from . import completion as completion
from . import endpoints as endpoints
from . import slots as slots
