"""OS processes and the supervised children made of them.

process    one OS process: spawn (own group, PDEATHSIG), its output logged, stop and reap
child      a supervised child: the state machine, the health gate, restarts with backoff
notify     sd_notify and the watchdog
llama_log  the level each line of llama.cpp's output is logged at
"""
