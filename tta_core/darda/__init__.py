"""DARDA: domain-aware adaptation with a bank of per-domain states. The domain recognition
and the state bank it shares with adashadow's `domain_bank` are tta_core.domain (embedding,
detector, bank, gate, switch); this room holds the rest of the paper: the method
(`method`: the online-learnt bank, and the paper's online phase from an offline bundle,
`paper`), trunk / banked BN set-up, robust BN and Eq. 15 (`bn`), RoTTA's class-balanced
memory (`memory`), the offline phase (`offline`, `offline_data`, `subnet`, `bundle`,
`corruption_memory`), the encoder's training (`encoder`) and bank files (`store`). No ROS
here.
"""
