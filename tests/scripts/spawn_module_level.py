"""What spawned ranks do with module-level code: they import the main module again.

Run with plain python; prints a line from module level (every process) and one from
under the main guard (the launching process only).
"""

import os

import stratagem as sg

print(f"module level in pid {os.getpid()}", flush=True)


def hello(strategy, ctx):
    return ctx.rank


if __name__ == "__main__":
    print("main guard", flush=True)
    print("ranks", sg.launch(hello, sg.ddp_spawn(device="cpu"), devices=2), flush=True)
