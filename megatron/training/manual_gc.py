"""--manual-gc: Python's automatic garbage collector off while training, and collections at
the same iterations on every rank instead (--manual-gc-interval, and around evaluation unless
--no-manual-gc-eval), as Megatron-LM does: an automatic collection pauses one rank at a
moment of its own, and every other rank waits for it at the next collective."""

import gc


class ManualGC:
    def __init__(self, training):
        self.on = training.manual_gc
        self.interval, self.around_eval = training.manual_gc_interval, training.manual_gc_eval
        self.was_enabled = None

    def start(self):
        if self.on:
            self.was_enabled = gc.isenabled()
            gc.disable()
            gc.collect()

    def after_iteration(self, iteration):
        if self.on and self.interval and iteration % self.interval == 0:
            gc.collect()

    def before_eval(self):
        if self.on and self.around_eval:
            gc.collect()

    def after_eval(self):
        if self.on and self.around_eval:
            gc.collect(generation=0)  # what evaluation made and dropped

    def stop(self):
        """Training is over: the collector as it was before."""
        if self.on and self.was_enabled:
            gc.enable()
