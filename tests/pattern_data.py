"""Training data for the run tests: deterministic rows from (seed, step) alone."""

import torch

VOCAB = 32


class PatternData:
    """Step i's rows depend on (seed, i) only; `shift` makes other data (another fingerprint)."""

    vocab_size = VOCAB

    def __init__(self, config, shift: int = 0):
        self.tokens = (torch.arange(2048) * 7 + shift) % VOCAB
        self.rows, self.seq_len, self.seed = config.batch_size, config.seq_len, config.seed
        self.fingerprint = f"pattern-{shift}"

    def _rows(self, g):
        starts = torch.randint(0, len(self.tokens) - self.seq_len - 1, (self.rows,), generator=g)
        return (torch.stack([self.tokens[s:s + self.seq_len] for s in starts]),
                torch.stack([self.tokens[s + 1:s + 1 + self.seq_len] for s in starts]))

    def train_batch(self, step):
        return self._rows(torch.Generator().manual_seed(self.seed * 1_000_003 + step))

    def eval_batches(self):
        return [self._rows(torch.Generator().manual_seed(7))]
