"""--rampup-batch-size START INCREMENT SAMPLES: a global batch that grows during training.

Megatron-LM's rule (its RampupBatchsizeNumMicroBatches): the ramp from START to
--global-batch-size G takes n = (G - START) / INCREMENT increments of SAMPLES / n samples each;
an iteration that starts with c samples consumed runs a global batch of

    G                                               when c > SAMPLES
    START + int(c / (SAMPLES / n)) x INCREMENT      otherwise

samples (in floating point, as Megatron computes it), each a whole number of micro batches x
data-parallel size. The run's length is given in samples (--train-samples): the iterations
are those of the ramp (until more than SAMPLES are consumed) plus the whole global batches
of G that fit in the rest, as Megatron-LM's update_train_iters counts them.
"""

import dataclasses
import functools

from megatron.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class BatchRampup:
    start: int
    increment: int
    samples: int
    final: int  # --global-batch-size

    @property
    def _samples_per_increment(self):
        return self.samples / ((self.final - self.start) // self.increment)

    def global_batch_at(self, consumed_samples):
        """The global batch of the iteration that starts after `consumed_samples`."""
        if consumed_samples > self.samples:
            return self.final
        return self.start + int(consumed_samples / self._samples_per_increment) * self.increment

    @functools.cached_property
    def ramp(self):
        """(iterations, samples consumed) until more than `samples` are consumed: Megatron's
        loop, one iteration at a time, taken here a run of equal batches at a time (the
        first iteration whose batch differs is found by bisection, so a ramp of millions of
        iterations costs a few thousand steps)."""
        iterations = consumed = 0
        while consumed <= self.samples:
            batch = self.global_batch_at(consumed)

            def ends_the_run(j, consumed=consumed, batch=batch):
                after = consumed + j * batch
                return after > self.samples or self.global_batch_at(after) != batch

            low, high = 1, (self.samples - consumed) // batch + 1  # ends_the_run(high)
            while low < high:
                middle = (low + high) // 2
                low, high = (low, middle) if ends_the_run(middle) else (middle + 1, high)
            iterations, consumed = iterations + low, consumed + low * batch
        return iterations, consumed

    def iterations_for(self, train_samples):
        """The run's iterations for --train-samples (the ramp's, then whole batches of G)."""
        ramp_iterations, ramp_samples = self.ramp
        return ramp_iterations + (train_samples - ramp_samples) // self.final

    def samples_after(self, iterations):
        """The samples consumed by the first `iterations` iterations."""
        ramp_iterations, ramp_samples = self.ramp
        if iterations >= ramp_iterations:
            return ramp_samples + (iterations - ramp_iterations) * self.final
        consumed = 0
        for _ in range(iterations):
            consumed += self.global_batch_at(consumed)
        return consumed

    def first_size_not_a_multiple_of(self, multiple):
        """The first global batch of the ramp (START, START + INCREMENT, ..., G) that is not a
        multiple of `multiple`, or None. (Whether START and INCREMENT are decides it: the ramp
        has at least those two sizes.)"""
        for size in (self.start, self.start + self.increment):
            if size % multiple:
                return size
        return None


def rampup_from_flags(raw, global_batch, named, per_step):
    """The BatchRampup of --rampup-batch-size (None without it), checked against the global
    batch G it ramps to (`named`: where G comes from, in words) and `per_step`, the samples of
    one micro batch on every data-parallel rank: every size of the ramp must be a whole number
    of those."""
    values = raw.get("rampup_batch_size")
    if values is None:
        return None
    start, increment, samples = values
    flag = f"--rampup-batch-size {start} {increment} {samples}"
    if min(values) <= 0:
        raise ConfigError(f"{flag}: the start batch, the increment and the ramp's samples must "
                          "be positive")
    if start >= global_batch:
        raise ConfigError(f"{flag} starts at {start} samples, not below {named}: there is "
                          "nothing to ramp up to (leave the flag out for a constant batch)")
    if (global_batch - start) % increment:
        raise ConfigError(f"{flag}: the ramp from {start} to {named} "
                          f"is not a whole number of increments of {increment} "
                          f"(({global_batch} - {start}) % {increment} = "
                          f"{(global_batch - start) % increment})")
    rampup = BatchRampup(start, increment, samples, global_batch)
    uneven = rampup.first_size_not_a_multiple_of(per_step)
    if uneven is not None and global_batch % per_step == 0:  # (else --global-batch-size's error)
        raise ConfigError(f"{flag}: the ramp's global batch of {uneven} samples is not a "
                          f"whole number of micro batches: --batch-size {raw['batch_size']} x "
                          f"data-parallel size {per_step // raw['batch_size']} = {per_step} "
                          f"({uneven} % {per_step} = {uneven % per_step}); make the start "
                          f"and the increment multiples of {per_step}")
    return rampup
