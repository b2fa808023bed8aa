"""A spawning script without ``if __name__ == "__main__":``, as newcomers write it."""

import stratagem as sg


def hello(strategy, ctx):
    return ctx.rank


print(sg.launch(hello, sg.ddp_spawn(device="cpu"), devices=2))
