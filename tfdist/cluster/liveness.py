"""Which of a set of TensorFlow servers are dead: gone, stalled, or never came.

One watcher for every engine: a ps task watches its run's workers
(`tfdist.ps.membership.LivenessWatcher`), a Stochastic Gradient Push worker the peers whose
messages it waits for (`tfdist.gossip.node`). `Liveness` probes its targets at once
(`ProbePool`: a stalled server's probe takes its whole deadline and must not delay the
others' answers), keeps each one's state (probes in a row that found nothing listening, when
it last answered, whether it ever did) and judges it by the rules its engine sets; the engine
keeps what is its own: which targets to watch, and what to do with a dead one.
"""

import collections
import threading
import time

from tfdist.cluster.probe import GONE
from tfdist.cluster.probe import STALLED
from tfdist.cluster.probe import ProbePool
from tfdist.cluster.probe import ServerProbe

# A server to watch: its "host:port", its task ("/job:worker/task:1"), and the clock time by
# which it must have answered once if it has not yet (None: judged from its first probe on,
# as one that answered then).
Target = collections.namedtuple("Target", ["address", "task", "came_by"], defaults=[None])

# A target found dead: its key, `GONE` or `STALLED` (the last probe's answer), and why, in
# words for a log line.
Dead = collections.namedtuple("Dead", ["key", "answer", "why"])


class Liveness:
    """Probes a set of targets at once and says which are dead, each once.

    A target that answered once (or whose `came_by` is None) is dead when its probes found
    nothing listening at its address `misses_to_dead` times in a row, or for more than
    `gone_timeout` seconds (a killed process), or when it has not answered for more than
    `stall_timeout` seconds while its port accepts connections (a stopped process, a hung
    machine); one that never answered is dead once its `came_by` has passed. A slow server is
    never cut off: its RPC threads answer while its training thread computes or waits. Time
    in which this watcher itself did not run (more than `stall_timeout` between two rounds:
    its process was stopped, a hung machine that recovered) counts for no target.

    Example:

        liveness = Liveness(stall_timeout=60, gone_timeout=10)
        for dead in liveness.check({1: Target("host:2223", "/job:worker/task:1")}):
            print(dead.key, dead.why)  # 1 no answer for 61 s, stall_timeout=60 s; ...

    Args:
      stall_timeout: seconds a target whose port accepts connections may go without
        answering (`check` may give another for a round: a ps task's runs carry their own).
      misses_to_dead: probes in a row finding nothing listening after which a target is dead
        (None: no such rule).
      gone_timeout: seconds a target may find nothing listening after its last answer (None:
        no such rule; with neither rule, `stall_timeout` counts for it too).
      probe: a `ServerProbe` (None: a new one, with its default deadline).
      clock: for tests (`time.monotonic`).
    """

    def __init__(self, stall_timeout, misses_to_dead=None, gone_timeout=None, probe=None,
                 clock=None):
        self.stall_timeout = stall_timeout
        self.misses_to_dead = misses_to_dead
        self.gone_timeout = gone_timeout
        self.probe = probe or ServerProbe()
        self._probes = ProbePool(self.probe)
        self._clock = clock or time.monotonic
        self.last_round = None  # the clock time of the last round's answers
        self.heard = {}  # key: when it last answered (its first probe's time, if never)
        self.answers = {}  # key: its probe's answer in the last round that probed it
        self._answered = set()  # keys that answered in the last round
        self._lock = threading.Lock()
        self._misses, self._seen, self._judged = {}, set(), set()

    def check(self, targets, stall_timeout=None):
        """Probes `targets` (`{key: Target}`) at once; returns `[Dead]` of those found dead
        in this round, each key once (until `forget`), in the order of `targets`."""
        with self._lock:  # several threads may ask (a worker's watchdog, its leave)
            return self._check(targets, stall_timeout)

    def _check(self, targets, stall_timeout):
        stall_timeout = self.stall_timeout if stall_timeout is None else stall_timeout
        started = self._clock()
        if self.last_round is not None and started - self.last_round > stall_timeout:
            # This watcher did not run meanwhile (its process stopped, or starved): the
            # others' silence since its last round is not theirs to answer for.
            gap = started - self.last_round
            self.heard = {key: heard + gap for key, heard in self.heard.items()}
        keys = list(targets)
        answers = self._probes([(targets[k].address, targets[k].task) for k in keys])
        self.last_round = now = self._clock()
        self._answered = set()
        found = []
        for key, answer in zip(keys, answers):
            self.answers[key] = answer
            if answer not in (GONE, STALLED):  # ANSWERED (or any answer a server gives)
                self._answered.add(key)
                self._misses[key] = 0
                self.heard[key] = now
                self._seen.add(key)
                continue
            silent = now - self.heard.setdefault(key, now)
            if answer == GONE:
                self._misses[key] = self._misses.get(key, 0) + 1
            if key in self._judged or not self._is_dead(key, targets[key], answer, silent,
                                                        now, stall_timeout):
                continue
            self._judged.add(key)
            address = targets[key].address
            why = (f"no answer for {silent:.0f} s, stall_timeout={stall_timeout:g} s; "
                   f"{self.probe.errors.get(address, '')}"
                   if answer == STALLED or not self._gone_rule() else
                   "nothing accepts connections there")
            found.append(Dead(key, answer, why))
        return found

    def _gone_rule(self):
        return self.misses_to_dead is not None or self.gone_timeout is not None

    def _is_dead(self, key, target, answer, silent, now, stall_timeout):
        if key not in self._seen and target.came_by is not None:
            return now > target.came_by
        if answer == GONE and self._gone_rule():
            return ((self.misses_to_dead is not None
                     and self._misses[key] >= self.misses_to_dead)
                    or (self.gone_timeout is not None and silent > self.gone_timeout))
        return silent > stall_timeout

    def answered_last_round(self, key):
        """Whether `key` answered the last round's probe."""
        return key in self._answered

    def forget(self, key):
        """Counts `key` afresh (misses, silence, verdict): it left, or died and was told.
        Whether it ever answered is kept: a target that comes back is judged as one seen."""
        for table in (self._misses, self.heard, self.answers):
            table.pop(key, None)
        self._judged.discard(key)

    def close(self):
        """Stops the probing threads and closes the probe's sessions."""
        self._probes.close()
