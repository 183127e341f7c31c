"""The one liveness watcher's rules, with a scripted probe and clock, in milliseconds.

Its users' own tests drive it as they use it: a ps's view of its workers and a worker's of
its ps tasks (`tests/ps/membership_test.py`), an SGP worker's of its peers
(`tests/strategies/sgp_test.py`, `PeerWatchTest`).
"""

import tensorflow as tf

from tfdist.cluster.liveness import Liveness
from tfdist.cluster.liveness import Target
from tfdist.cluster.probe import ANSWERED
from tfdist.cluster.probe import GONE
from tfdist.cluster.probe import STALLED


class ScriptedProbe:
    timeout = 2.0

    def __init__(self):
        self.answers, self.errors = {}, {}

    def __call__(self, address, task):
        return self.answers.get(address, ANSWERED)

    def close(self):
        pass


class LivenessTest(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        self.now = 0.0
        self.probe = ScriptedProbe()

    def liveness(self, **rules):
        liveness = Liveness(probe=self.probe, clock=lambda: self.now, **rules)
        self.addCleanup(liveness.close)
        return liveness

    def rounds(self, liveness, targets, until, step=0.5):
        """`{key: (time found dead, Dead)}` of the rounds up to `until`."""
        found = {}
        while self.now < until:
            for dead in liveness.check(targets):
                found[dead.key] = (self.now, dead)
            self.now += step
        return found

    def test_gone_by_time_or_by_misses_stalled_by_time_each_told_once(self):
        targets = {k: Target(f"host:{k}", f"/job:worker/task:{k}") for k in range(2)}
        by_time = self.liveness(stall_timeout=5.0, gone_timeout=2.0)
        self.assertEqual(self.rounds(by_time, targets, 1.0), {})
        self.probe.answers = {"host:0": GONE, "host:1": STALLED}
        self.probe.errors["host:1"] = "DeadlineExceededError: Deadline Exceeded"
        found = self.rounds(by_time, targets, 20.0)
        self.assertEqual(found[0][0], 3.0)  # last answered at 0.5 s: silent 2.5 s > 2 s
        self.assertEqual(found[0][1].why, "nothing accepts connections there")
        self.assertEqual(found[1][0], 6.0)
        self.assertEqual(found[1][1].why, "no answer for 6 s, stall_timeout=5 s; "
                                          "DeadlineExceededError: Deadline Exceeded")

        self.now, self.probe.answers = 0.0, {}
        by_misses = self.liveness(stall_timeout=5.0, misses_to_dead=3)
        self.rounds(by_misses, targets, 1.0)
        self.probe.answers = {"host:0": GONE}
        found = self.rounds(by_misses, targets, 20.0)
        self.assertEqual(list(found), [0])
        self.assertEqual(found[0][0], 2.0)  # the third miss in a row

    def test_time_the_watcher_itself_did_not_run_counts_for_no_target(self):
        # The watcher's own process was stopped for 30 s (a woken worker's watch of its ps
        # tasks): a target that does not answer its first probe after that is not dead for
        # the 30 s (it blamed the ps before: issue 22), only after stall_timeout more.
        targets = {0: Target("host:0", "/job:ps/task:0")}
        liveness = self.liveness(stall_timeout=5.0)
        self.assertEqual(self.rounds(liveness, targets, 1.0), {})
        self.now += 30.0
        self.probe.answers = {"host:0": STALLED}
        found = self.rounds(liveness, targets, 45.0)
        self.assertEqual(list(found), [0])
        self.assertGreater(found[0][0], 31.0 + 5.0)
        self.assertRegex(found[0][1].why, r"^no answer for [56] s, stall_timeout=5 s")

    def test_never_came_is_judged_by_came_by_and_forget_keeps_seen(self):
        liveness = self.liveness(stall_timeout=5.0, misses_to_dead=2)
        self.probe.answers = {"host:0": GONE}
        late = {0: Target("host:0", "/job:worker/task:0", came_by=10.0)}
        found = self.rounds(liveness, late, 20.0)
        self.assertEqual(found[0][0], 10.5)  # not at its second miss: it never came
        self.assertFalse(liveness.answered_last_round(0))

        # Seen once, then forgotten (it died and was told): judged as one seen.
        self.now, self.probe.answers = 20.0, {}
        liveness.check(late)
        self.assertTrue(liveness.answered_last_round(0))
        liveness.forget(0)
        self.probe.answers = {"host:0": GONE}
        found = self.rounds(liveness, late, 30.0)
        self.assertEqual(found[0][0], 20.5)  # its second miss in a row


if __name__ == "__main__":
    tf.test.main()
