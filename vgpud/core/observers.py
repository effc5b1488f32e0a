"""One way to hear about changes: an Observer's ``notify(event)``.

A subject (the Ledger, the GroupTracker, the Manager, the scheduler service)
publishes its changes as values through a Topic; each observer matches on the
values it cares about. Subjects never subscribe anyone: vgpud.app makes every
subscription, so the wiring of the daemon can be read in one place.
Observers hear in the order they subscribed.
"""

from __future__ import annotations

from typing import Generic, Protocol, TypeVar

__all__ = ["Observer", "Topic"]

E = TypeVar("E")
E_contra = TypeVar("E_contra", contravariant=True)


class Observer(Protocol[E_contra]):
    def notify(self, event: E_contra, /) -> None: ...


class Topic(Generic[E]):
    """The observers of one subject. A Topic is an Observer too: ``notify``
    hands the event to each, in subscription order; one that raises stops
    the rest (the subject's caller sees the exception)."""

    __slots__ = ("_observers",)

    def __init__(self) -> None:
        self._observers: tuple[Observer[E], ...] = ()

    def subscribe(self, observer: Observer[E]) -> None:
        if observer in self._observers:
            raise ValueError(f"{observer!r} is already subscribed")
        self._observers += (observer,)

    def unsubscribe(self, observer: Observer[E]) -> None:
        """Stop notifying ``observer``; one not subscribed is no error."""
        self._observers = tuple(o for o in self._observers if o is not observer)

    def notify(self, event: E, /) -> None:
        for observer in self._observers:
            observer.notify(event)

    def __bool__(self) -> bool:
        """Whether anyone listens (a subject may skip building an event)."""
        return bool(self._observers)

    def __contains__(self, observer: object) -> bool:
        return observer in self._observers

    def __len__(self) -> int:
        return len(self._observers)
