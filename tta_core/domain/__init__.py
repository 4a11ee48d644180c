"""Domain recognition and per-domain state, below the paper rooms: the darda method and
adashadow's `domain_bank` option both use it, and no paper room imports another.

Modules: embedding (batch embedding from forward pre-hooks: channel moments, the fixed
corruption residual, optionally the learnt corruption encoder of `encoder`), table +
detector (centroids, spreads, hysteresis, novelty; the shift test inside a domain), bank
(per-domain state swapped by copy), gate (when to adapt), switch (detector + bank + gate
for one method: `DomainSwitch`; `bank_switch`, `gated_step` for an adapter that updates
BatchNorm affine only). Training the encoder is DARDA's (tta_core.darda.encoder). See
README.md here.
"""
