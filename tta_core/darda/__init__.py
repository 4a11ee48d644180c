"""Domain bank (DARDA, issue #21): shift and domain detection from low-layer channel
moments, per-domain adapted states swapped by copy, adapt-until-stable gating, a
label-balanced memory for the BN refresh, and safetensors persistence. No ROS here.

Modules: embedding (batch embedding, hook collector, corruption residual), encoder
(DARDA's learnt corruption encoder, optional), table + detector (centroids, hysteresis,
novelty), bank (state swap), switch (detector + bank + gate for one method: darda, and
adashadow's `domain_bank`), bn (trunk / banked BN set-up, robust BN, Eq. 15), gate (when
to adapt), memory (RoTTA's CSTU), store (bank files). The method is
`tta_core.darda.method`.
"""
