# The compiled twin of aiodist.work.Work (_work.pyx): aiodist.work chooses it when it loads.
from typing import Any

def bind(dropped: Any, wait_future: Any) -> None: ...

Work: Any
