"""An executor spun in a background thread that stops without racing its callbacks.

rclpy's `Executor.shutdown(timeout_sec)` destroys the executor's guard condition at once,
even while another thread is inside one of its callbacks (the wait for running callbacks
is skipped once the shutdown flag is set), and that thread then dies with `InvalidHandle:
cannot use Destroyable because destruction was requested`; a join with a short timeout
after it lets the nodes be destroyed under a running perception step. `SpinThread.stop`
ends the spin loop after the callback it is running, waits for the thread, and only then
shuts the executor down.
"""

from __future__ import annotations

import threading

from rclpy.executors import Executor


class SpinThread:
    """Spins `executor` (its nodes added by the caller) in a daemon thread until `stop()`.

    `poll_s` bounds how long a stop waits for an idle executor; a callback that is running
    is always finished first."""

    def __init__(self, executor: Executor, name: str = "tta-spin", poll_s: float = 0.05
                 ) -> None:
        if not poll_s > 0:
            raise ValueError(f"poll_s must be > 0, got {poll_s}")
        self.executor, self.poll_s = executor, float(poll_s)
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        ex = self.executor
        while not self._stop.is_set() and ex.context.ok():
            try:
                ex.spin_once(timeout_sec=self.poll_s)
            except Exception:  # the context shut down under the executor: done
                if ex.context.ok():
                    raise
                return

    def stop(self, timeout_s: float | None = None) -> bool:
        """End the loop after the running callback, wait for the thread (`timeout_s`: at
        most that long; None: until it ends), then shut the executor down. False when the
        thread was still running a callback at the timeout (the executor is left up)."""
        self._stop.set()
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            return False
        self.executor.shutdown(timeout_sec=0)
        return True
