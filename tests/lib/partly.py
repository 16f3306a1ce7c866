"""The one allowance both crash checks make for a file whose change is not acknowledged yet."""


class Partly:
    """A file being written (new: `old` empty) or rewritten in place (O_TRUNC, then its new
    bytes), not yet acknowledged: any length up to the longer of the two, each byte the new
    content's, the old content's (the daemon may write the new bytes over the old ones, the
    size set first) or zero (a hole, or truncated first and not yet written)."""

    def __init__(self, old, new):
        self.old, self.new = old or b"", new

    def allows(self, state):
        if state is None:
            return False
        longest = max(len(self.old), len(self.new))
        if len(state) > longest:
            return False
        old, new = self.old.ljust(longest, b"\0"), self.new.ljust(longest, b"\0")
        return all(s == o or s == n or s == 0 for s, o, n in zip(state, old, new))

    def __str__(self):
        if not self.old:
            return f"up to {len(self.new)} bytes"
        return f"{len(self.old)} bytes rewritten as {len(self.new)}"
