"""Two spawned ranks, rank 0 with a tqdm bar: run under a terminal, nothing may leak."""

from tqdm import tqdm

import stratagem as sg


def train(strategy, ctx):
    for _ in tqdm(range(3), disable=not ctx.is_main):
        pass
    return ctx.rank


if __name__ == "__main__":
    print(sg.launch(train, sg.ddp_spawn(device="cpu"), devices=2))
