"""stratagem.testing: check that a strategy obeys what every strategy promises.

`World` runs functions on persistent local ranks; `laws` holds the checks, each
a plain function that raises ``AssertionError`` naming the law, the strategy,
the input and the difference; `check_all` runs every law that applies and
returns a `Report`. A strategy states what it promises with a `Contract`.
Hypothesis search strategies live in `stratagem.testing.strategies`, the only
module here that imports hypothesis.
"""

from stratagem.testing import laws as laws
from stratagem.testing.check import Report as Report
from stratagem.testing.check import check_all as check_all
from stratagem.testing.contract import Contract as Contract
from stratagem.testing.laws import LawViolation as LawViolation
from stratagem.testing.world import World as World
from stratagem.testing.world import WorldTimeoutError as WorldTimeoutError

__all__ = [
    "Contract",
    "LawViolation",
    "Report",
    "World",
    "WorldTimeoutError",
    "check_all",
    "laws",
]
