"""Checkpoints written during a run: at the end of every epoch, after every --checkpoint-every
updates mid-epoch, and where --max-steps ends the run.

    Writer      checkpoint.save in the step's thread, or (--async-checkpoint) in a thread of its
                own: the step has already copied the state to the host (Strategy.state_dict's
                numpy arrays), so training goes on while the file is written, hashed and fsynced.
                One write at a time: the next save waits for the last. checkpoint.save renames a
                complete file over the old one, so a kill -9 during a write leaves the previous
                checkpoint as it was.
    mid_epoch   fit's after_update hook: saves with the epoch's Cursor (loop.Cursor) and the
                random state the epoch drew its order from, so that --resume skips the batches
                already taken, in the same order, and ends with the bits of an uninterrupted run.
"""
import dataclasses
import threading

from .. import checkpoint


class Writer:
    """Saves checkpoints to `directory`, in the background when `background`."""

    def __init__(self, directory, background):
        self.directory, self.background = directory, background
        self.thread, self.error = None, None

    def save(self, state, meta):
        """Write (state, meta); in the background, after the previous write has ended. A failed
        background write raises its CheckpointError at the next save or at wait()."""
        self.wait()
        if not self.background:
            checkpoint.save(self.directory, state, meta)
            return
        self.thread = threading.Thread(target=self._write, args=(state, meta), name="checkpoint-writer")
        self.thread.start()

    def _write(self, state, meta):
        try:
            checkpoint.save(self.directory, state, meta)
        except Exception as e:      # noqa: BLE001 -- handed to the training thread, raised there
            self.error = e

    def wait(self):
        """Until the last write has ended; its error, if it failed."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            error, self.error = self.error, None
            raise error


def mid_epoch(cfg, model, save, epoch_rng):
    """fit's after_update(epoch, where): after every --checkpoint-every-th update, and at
    --max-steps (ending the run there), `save(epoch - 1, where(), epoch_rng())`: the epochs
    completed, the Cursor of this one, the random state it started from. Returns whether to stop."""
    def after_update(epoch, where):
        stop = bool(cfg.max_steps) and model.t >= cfg.max_steps
        if cfg.checkpoint_dir and (stop or (cfg.checkpoint_every and model.t % cfg.checkpoint_every == 0)):
            save(epoch - 1, dataclasses.asdict(where()), epoch_rng())
        return stop
    return after_update if cfg.checkpoint_every or cfg.max_steps else None
