"""What a change asks of the loop: publish the routing table again, or run a pass now."""


class Flags:
    def __init__(self):
        self.routes_dirty = True  # the table changed: publish it (and bump its seq)
        self.wake = False  # run a pass now, not at the next tick (set by the admin API)
