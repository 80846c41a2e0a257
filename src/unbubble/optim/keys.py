"""State and parameter-group keys of unbubble's optimizers, written once.

Every key below is checkpointed: ``torch.optim.Optimizer.state_dict`` saves the per-parameter
state dictionaries and the group options as they are, and ``load_state_dict`` restores them (it
casts floating-point state tensors to the parameter's dtype and device and leaves ``step`` alone).

Per-parameter state of ``BasisRotation`` (paper names from arXiv 2602.03515, Algorithms 1 and 2;
SOAP's ``soap.py`` names in brackets). W is an m x n weight matrix.
"""

# --- Per-parameter state, every parameter ---------------------------------------------------
STEP = "step"
"""Updates applied to this parameter: float32 0-dim tensor, as ``torch.optim.AdamW`` keeps it."""

EXP_AVG = "exp_avg"
"""First moment M, shape of the parameter. For a rotated matrix with ``EXP_AVG_ROTATED`` it is kept
in the *rotated* basis, M~ = U^T M V (see [Note: first moment in the rotated basis] in
docs/architecture.md), otherwise in the original space."""

EXP_AVG_ROTATED = "exp_avg_rotated"
"""Python bool, rotated matrices only: whether ``EXP_AVG`` holds M~ (update_freq ≥ 3) or M."""

EXP_AVG_SQ = "exp_avg_sq"
"""Second moment V~, shape of the parameter; for a rotated matrix it lives in the rotated basis
and is only permuted (never rotated) when the basis is refreshed."""

# --- Per-parameter state, rotated matrices only -----------------------------------------------
BASIS_LEFT = "basis_left"
"""U, (m, m) orthogonal, columns in descending eigenvalue order [Q[0]]. Absent when the left side
is not rotated (unilateral on a matrix with m >= n, or m > max_precond_dim)."""

BASIS_RIGHT = "basis_right"
"""V, (n, n) orthogonal [Q[1]]. Absent when the right side is not rotated."""

FACTOR_LEFT = "factor_left"
"""L = EMA(G G^T), (m, m) [GG[0]]; only with source "2nd" and a rotated left side."""

FACTOR_RIGHT = "factor_right"
"""R = EMA(G^T G), (n, n) [GG[1]]; only with source "2nd" and a rotated right side."""

REFRESHES = "refreshes"
"""Basis refreshes done so far (Python int); 0 means the bases are still the identity and the
next refresh is the cold start (full ``eigh``)."""

ROTATED_STATE_KEYS = (BASIS_LEFT, BASIS_RIGHT, FACTOR_LEFT, FACTOR_RIGHT)
"""State that AdamW does not have: what ``optimizer_state_bytes`` reports as extra."""

# --- Parameter-group options of BasisRotation -------------------------------------------------
ROTATE = "rotate"
"""Group flag: False gives the group's matrices plain AdamW (embeddings, head); default True."""

SOURCE = "source"
GEOMETRY = "geometry"
UPDATE_FREQ = "update_freq"
START_STEP = "start_step"
MAX_PRECOND_DIM = "max_precond_dim"
FACTOR_BETA = "factor_beta"
