"""The perception node's domain side: bank persistence and domain reporting.

With a method that recognises domains (tta_core.api.ReportsDomain, e.g. darda) the node
reports the ongoing domain on /diagnostics (`<node>: domain`) and logs each switch once
(INFO). A method with a bank (`save_bank`, darda) has the option `method.bank_path`: loaded
at start (a bad file is reported once, WARN, and the method starts with an empty bank) and
saved there atomically every `DomainWiring.save_s` (60 s), before the method is rebuilt and
when the node is destroyed.

Services (std_srvs/Trigger): `~/save_domain_bank` saves the bank to `method.bank_path`
now; `~/clear_domain_bank` forgets every domain (the method is reset to the source state,
an empty bank) and marks the bank for the next save, so a restart does not bring the old
domains back. Both answer success=False with one line when the method has no domain bank
(or, for save, no path is set).

Threading: the save timer only raises a flag and a service call hands its request to the
perception worker and waits for the answer (up to SERVICE_WAIT_S); the worker saves and
clears between two batches (`between_batches`), so neither ever runs while a batch is
stepped. At shutdown the node saves after its worker has been joined, and before a method
rebuild it saves the old method's bank (the rebuilt one loads it). A relative bank_path is
taken relative to
the node's working directory (it is written, so never looked up in the repository or an
install's share directory, unlike model_card: tta_ros.ros_params.resolve_output_path).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diagnostic_msgs.msg import DiagnosticStatus
from rclpy.node import Node
from std_srvs.srv import Trigger

from tta_core.api import ReportsDomain, StepResult
from tta_core.io.image_msg import one_line
from tta_ros.diagnostics import OK, WARN, status

SERVICE_WAIT_S = 10.0  # a service call waits this long for the worker (a batch, a frame)
#: tta_core loggers that warn about a bank file they could not load; the node reports the
#: same error itself (DomainWiring.attach, on its own logger), so they are muted meanwhile
BANK_LOGGERS = ("tta_core.darda.method",)


class _BelowWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.WARNING


@dataclass
class _Request:
    """One service call handed to the worker."""

    kind: str  # "save" or "clear"
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: bool = False
    error: str = ""  # '' on success
    message: str = ""


class DomainWiring:
    """Domain reporting and bank saving of one perception node (see the module docstring)."""

    save_s = 60.0  # periodic save of the bank (seconds; 0: none), fixed when the node starts

    def __init__(self, node: Node) -> None:
        self.node = node
        self.path = ""  # the attached method's bank file ('': none)
        self._save_requested = threading.Event()
        self._dirty = False  # batches since the last save
        self.method: Any = None
        self._reported = False
        self.domain, self.switches, self.batches, self.backwards = "", 0, 0, 0
        self.last: dict[str, Any] = {}
        self.bank_error = self.save_error = ""
        self.saves, self._bad_file = 0, False
        if self.save_s > 0:
            node.create_timer(float(self.save_s), self._save_requested.set)
        self._requests: queue.Queue[_Request] = queue.Queue()
        for kind in ("save", "clear"):
            node.create_service(Trigger, f"~/{kind}_domain_bank",
                                lambda _req, resp, k=kind: self._serve(k, resp))

    @property
    def active(self) -> bool:
        """Whether the current method reports domains (ReportsDomain, or a batch came with
        a domain: adashadow with `domain_bank`)."""
        return isinstance(self.method, ReportsDomain) or self._reported

    @property
    def banks(self) -> bool:
        return bool(self.path) and hasattr(self.method, "save_bank")

    # ---------------------------------------------------------------- method lifecycle
    @staticmethod
    @contextmanager
    def loading() -> Iterator[None]:
        """While a method is built: tta_core's own warning about a bank file it could not
        load is muted, so the node's one line (attach) is the only one."""
        mute, loggers = _BelowWarning(), [logging.getLogger(n) for n in BANK_LOGGERS]
        for lg in loggers:
            lg.addFilter(mute)
        try:
            yield
        finally:
            for lg in loggers:
                lg.removeFilter(mute)

    def attach(self, method: Any, path: str) -> None:
        """A (re)built method and its bank file (absolute, '' for none): report a bank that
        could not be loaded, once."""
        self.method, self.path = method, path
        self.domain, self._dirty, self._reported = "", False, False
        self.bank_error = one_line(getattr(method, "bank_error", "") or "")
        self._bad_file = bool(self.bank_error)
        if self.bank_error:
            self.node.get_logger().warning(f"domain bank not loaded, starting empty: "
                                           f"{self.bank_error}")

    def save(self, why: str, force: bool = False) -> str:
        """Save the bank now (worker thread between batches, or the worker stopped) if a
        batch changed it (or `force`); the error in one line, '' when saved or clean."""
        if not self.banks or not (self._dirty or force):
            return ""
        try:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            if self._bad_file and Path(self.path).is_file():  # keep the bad file aside
                Path(self.path).replace(self.path + ".bad")
            self._bad_file = False
            self.method.save_bank(self.path)
        except (OSError, RuntimeError, ValueError) as exc:
            self.save_error = one_line(f"{type(exc).__name__}: {exc}")
            self.node.get_logger().warning(f"domain bank not saved ({why}): {self.save_error}")
            return self.save_error
        self._dirty, self.save_error, self.saves = False, "", self.saves + 1
        self.node.get_logger().debug(f"domain bank saved to {self.path} ({why})")
        return ""

    def between_batches(self) -> None:
        """Worker thread: save when the timer asked for it; serve pending service calls."""
        if self._save_requested.is_set():
            self._save_requested.clear()
            self.save("periodic")
        while not self._requests.empty():
            req = self._requests.get_nowait()
            if not req.cancelled:
                req.error, req.message = self._execute(req.kind)
            req.done.set()

    def _execute(self, kind: str) -> tuple[str, str]:
        """(error, message) of one service request, on the worker between batches."""
        if kind == "save":
            if not self.banks:
                return "no domain bank to save (method without one, or method.bank_path " \
                       "is empty)", ""
            err = self.save("service", force=True)
            return err, f"domain bank saved to {self.path}"
        if not self.active and not hasattr(self.method, "save_bank"):
            return f"method {type(self.method).__name__} has no domain bank to clear", ""
        self.method.reset()  # source state, empty bank
        self.domain, self.last, self._dirty = "", {}, bool(self.path)
        self.node.get_logger().info("domain bank cleared (service)")
        return "", "domain bank cleared"

    def _serve(self, kind: str, response: Trigger.Response) -> Trigger.Response:
        """Service callback (executor thread): hand over to the worker and wait."""
        req = _Request(kind)
        self._requests.put(req)
        if not req.done.wait(SERVICE_WAIT_S):
            req.cancelled = True
            response.success = False
            response.message = f"{kind}: the perception worker did not answer within " \
                               f"{SERVICE_WAIT_S:.0f} s (a batch still running)"
            return response
        response.success, response.message = not req.error, req.error or req.message
        return response

    def close(self, worker: threading.Thread | None) -> None:
        """Node destroyed: save unless the worker is still running a batch."""
        if worker is not None and worker.is_alive():
            self.node.get_logger().warning("domain bank not saved: the worker did not stop")
            return
        self.save("shutdown")

    # ---------------------------------------------------------------- reporting
    def on_batch(self, res: StepResult) -> None:
        """Count the batch; log a domain change once (INFO)."""
        self._reported = self._reported or bool(res.domain)
        if not self.active:
            return
        self._dirty = True
        self.batches += 1
        self.last = dict(res.stats or {})
        self.backwards += bool(self.last.get("backward", res.adapted))
        if res.domain and res.domain != self.domain:
            if self.domain:
                self.switches += 1
            how = "new" if self.last.get("created") else "known"
            self.node.get_logger().info(f"domain: {self.domain or '-'} -> {res.domain} "
                                        f"({how}, {self.last.get('domains', '?')} known)")
            self.domain = res.domain

    def statuses(self) -> list[DiagnosticStatus]:
        """The `domain` status ([] when the method does not report domains)."""
        if not self.active and not self.bank_error:
            return []
        s = self.last
        share = self.backwards / self.batches if self.batches else 0.0
        problem = (f"domain bank not saved: {self.save_error}" if self.save_error else
                   f"domain bank not loaded: {self.bank_error}" if self.bank_error else "")
        message = problem or (f"domain {self.domain} ({s.get('domains', 0)} known)"
                              if self.domain else "no batch yet")
        return [status("domain", WARN if problem else OK, message, {
            "domain": self.domain, "domains": s.get("domains", 0),
            "switched": bool(s.get("switched", False)), "created": bool(s.get("created", False)),
            "novel": bool(s.get("novel", False)), "backward_share": float(share),
            "switches": self.switches, "bank_path": self.path or "-", "saves": self.saves})]
