"""Stop strings over streamed text: hold back only what could still turn into a stop string."""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str]) -> None:
        self._stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False
        self.matched = ""  # the stop string that ended it

    def feed(self, text: str) -> str:
        """Returns the text that is safe to emit now; sets `stopped` once a stop string appears."""
        if self.stopped:
            return ""
        self._held += text
        found = [(i, s) for s in self._stops if (i := self._held.find(s)) >= 0]
        if found:
            cut, self.matched = min(found)
            self.stopped = True
            emitted, self._held = self._held[:cut], ""
            return emitted
        keep = self._longest_partial_stop()
        emitted = self._held[: len(self._held) - keep]
        self._held = self._held[len(self._held) - keep :]
        return emitted

    def flush(self) -> str:
        """At the end of generation, what was held back was not a stop string after all."""
        rest, self._held = ("" if self.stopped else self._held), ""
        return rest

    def _longest_partial_stop(self) -> int:
        longest = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(self._held)), 0, -1):
                if self._held.endswith(stop[:n]):
                    longest = max(longest, n)
                    break
        return longest
