r"""Rotating shallow-water equations on an Arakawa C-grid (f-plane, doubly periodic).

Equations
---------
On the doubly periodic box :math:`[0, L_x)\times[0, L_y)` with rest depth
:math:`H(x, y) > 0`, surface elevation :math:`\eta`, total depth :math:`h = H + \eta` and
velocity :math:`(u, v)`, we solve the nonlinear rotating shallow-water equations in
vector-invariant form

.. math::

    \eta_t &= -\partial_x(h u) - \partial_y(h v),\\
    u_t &= +(f + \zeta)\,v - \partial_x(g\eta + K) - r u + \nu\nabla^2 u,\\
    v_t &= -(f + \zeta)\,u - \partial_y(g\eta + K) - r v + \nu\nabla^2 v,

with relative vorticity :math:`\zeta = v_x - u_y`, kinetic energy per unit mass
:math:`K = \tfrac12(u^2 + v^2)`, constant Coriolis parameter ``f`` (f-plane), gravity
``g``, linear bottom drag ``r`` (``drag``) and Laplacian viscosity :math:`\nu`
(``viscosity``).  For :math:`r = \nu = 0` mass :math:`\int h\,dA` and energy
:math:`\int \tfrac12 h|\mathbf u|^2 + \tfrac12 g\eta^2\,dA` are conserved.

Layout (Arakawa C-grid)
-----------------------
The state is one tensor ``state`` of shape ``(..., 3, ny, nx)`` with channels
``(eta, u, v)``; row index ``j`` is y (dim ``-2``), column index ``i`` is x (dim ``-1``),
leading batch dimensions are allowed.  With :math:`\Delta x = L_x/n_x`,
:math:`\Delta y = L_y/n_y`:

* ``eta[j, i]`` and ``depth[j, i]`` live at cell centres
  :math:`((i+\tfrac12)\Delta x, (j+\tfrac12)\Delta y)`;
* ``u[j, i]`` at east faces :math:`((i+1)\Delta x, (j+\tfrac12)\Delta y)`;
* ``v[j, i]`` at north faces :math:`((i+\tfrac12)\Delta x, (j+1)\Delta y)`;
* vorticity and potential vorticity at north-east corners
  :math:`((i+1)\Delta x, (j+1)\Delta y)`.

``depth`` has shape ``(..., ny, nx)`` broadcastable with ``eta`` and may require grad.

Discretisation
--------------
With two-point averages :math:`\overline{a}^x, \overline{a}^y` and differences
:math:`\delta_x a, \delta_y a` (each mapping a field to the point half-way between its
neighbours):

* mass fluxes :math:`U = \overline{h}^x u` (at u-points), :math:`V = \overline{h}^y v`
  (at v-points); flux-form continuity :math:`\eta_t = -\delta_x U - \delta_y V`, which
  telescopes, so :math:`\sum h` is conserved to round-off on the periodic grid;
* potential vorticity at corners :math:`q = (f + \delta_x v - \delta_y u)/h_q`,
  :math:`h_q = \overline{\overline{h}^x}^y` (four-point average);
* Sadourny's (1975) **energy-conserving** Coriolis/vorticity term

  .. math::

      u_t \ni +\overline{q\,\overline{V}^x}^y, \qquad
      v_t \ni -\overline{q\,\overline{U}^y}^x,

  and the Bernoulli function :math:`B = g\eta + K`,
  :math:`K = \tfrac12(\overline{u^2}^x + \overline{v^2}^y)` at cell centres, whose
  gradients :math:`\delta_x B, \delta_y B` act on u and v;
* drag :math:`-r u, -r v` and the five-point Laplacian :math:`\nu\nabla^2_h` on u and v.

Properties of the semi-discrete system (exact up to round-off on the periodic grid):

* mass :math:`\sum h\,\Delta A` is conserved (flux form);
* for :math:`r = \nu = 0` the energy (:func:`energy`)

  .. math::

      E = \sum_{\text{centres}} \bigl[\tfrac12 h\,(\overline{u^2}^x + \overline{v^2}^y)
          + \tfrac12 g\eta^2\bigr]\Delta A
        = \sum_u \tfrac12 \overline{h}^x u^2 + \sum_v \tfrac12 \overline{h}^y v^2
          + \sum \tfrac12 g \eta^2

  is conserved: the Coriolis/vorticity terms do no work
  (:math:`\sum U\,\overline{q\overline V^x}^y = \sum q\,\overline U^y\,\overline V^x
  = \sum V\,\overline{q\overline U^y}^x`), and the pressure/Bernoulli work cancels the
  change of :math:`\sum (g\eta + K)h` through the continuity equation (summation by
  parts).  Drag removes :math:`r\sum(\overline{h}^x u^2 + \overline{h}^y v^2)\Delta A`
  per unit time.  (Potential enstrophy is *not* conserved; Arakawa & Lamb 1981 would
  conserve both.)  RK4 in time adds an :math:`O(\Delta t^4)` energy error over a fixed
  time;
* lake at rest (:math:`\eta = u = v = 0`, any :math:`H`) is an exact steady state: every
  tendency is a product with zero fluxes or a gradient of :math:`B = 0`;
* linearised about rest with flat depth, fields varying only in x with wavenumber
  :math:`k`, :math:`c = \cos(k\Delta x/2)`, :math:`s = 2\sin(k\Delta x/2)/\Delta x`:
  :math:`\hat u_t = f c\,\hat v - g\,i s\,\hat\eta`, :math:`\hat v_t = -f c\,\hat u`,
  :math:`\hat\eta_t = -H\,i s\,\hat u` (amplitudes of :math:`e^{ikx}` at each field's own
  points), frequencies :math:`0, \pm\omega` with :math:`\omega^2 = f^2c^2 + gHs^2`
  (second-order accurate to :math:`f^2 + gHk^2`), see :func:`inertia_gravity_exact`;
  the :math:`\omega = 0` mode is the discrete geostrophic balance
  :math:`f c\,\hat v = g\,i s\,\hat\eta`, :math:`\hat u = 0` (:func:`geostrophic_state`).

Time stepping is classical RK4 (:func:`deepsolve.physics.time_stepping.rk4`).  The
fastest C-grid gravity wave has :math:`\omega\Delta t = \sqrt{gH}\,\Delta t\,
\sqrt{s_x^2 + s_y^2} \le 2\sqrt2` (RK4's imaginary-axis limit) on square cells iff
``cfl(max(depth)) <= 1`` (:meth:`ShallowWater2D.cfl`); keep it below ~0.5 for accuracy
(RK4 damps such a wave by :math:`(\omega\Delta t)^6/144` per step).

Slabs of rows and halos
-----------------------
x (dim ``-1``) is always entirely local (``torch.roll``).  Along y every stencil above
reaches at most one row away, so :meth:`ShallowWater2D.rhs` stacks
``(eta, u, v, depth)`` into one ``(..., 4, rows, nx)`` tensor, calls
``pad(x, 1)`` **once** (:meth:`ShallowWater2D.halo` is 1) and then computes only from the
padded tensor, producing the tendencies of the ``rows`` local rows.  With the default
:func:`circular_pad` the local rows are the whole periodic grid; a caller that owns rows
``j0 .. j0+rows-1`` passes a ``pad`` that fetches one row from each neighbour (a halo
exchange) and gets exactly the global result on its rows.  :meth:`ShallowWater2D.step`
calls ``pad`` four times (once per RK4 stage), or with ``exchange="step"`` once, with 4
rows: the stages are then computed on the local rows plus a halo that shrinks by one row
per stage (communication-avoiding RK4: a quarter of the exchanges, each a few rows wider,
for ``3 + 2 + 1`` rows of redundant work per side; the same bits as ``"stage"``).

Everything is written with out-of-place torch operations: differentiable with autograd
(also with respect to ``depth``), any device, float32 or float64, no host
synchronisation inside :meth:`~ShallowWater2D.rhs` / :meth:`~ShallowWater2D.step`.

References
----------
* A. Arakawa, V. R. Lamb, "Computational design of the basic dynamical processes of the
  UCLA general circulation model", Methods Comput. Phys. 17, 173 (1977) -- the C-grid.
* R. Sadourny, "The dynamics of finite-difference models of the shallow-water
  equations", J. Atmos. Sci. 32, 680 (1975) -- energy-conserving vorticity averaging.
* A. Arakawa, V. R. Lamb, "A potential enstrophy and energy conserving scheme for the
  shallow water equations", Mon. Wea. Rev. 109, 18 (1981).
* D. R. Durran, *Numerical Methods for Fluid Dynamics*, 2nd ed., Springer (2010),
  Sec. 4.3 -- dispersion of inertia-gravity waves on staggered grids.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from deepsolve.physics.time_stepping import rk4

__all__ = [
    "ShallowWater2D",
    "circular_pad",
    "mass",
    "energy",
    "geostrophic_state",
    "inertia_gravity_frequency",
    "inertia_gravity_exact",
    "gaussian_bump",
]

Pad = Callable[[torch.Tensor, int], torch.Tensor]
Scalar = float | int | torch.Tensor

#: stencil reach along y (rows) of every operator in :meth:`ShallowWater2D.rhs`
HALO = 1


def circular_pad(x: torch.Tensor, width: int) -> torch.Tensor:
    """Extend ``x`` periodically by ``width`` rows on each side of dim ``-2``.

    The default ``pad`` of :class:`ShallowWater2D`: the local rows are the whole periodic
    grid.  ``(..., rows, nx) -> (..., rows + 2*width, nx)``; needs ``width <= rows``.
    """
    return torch.cat([x[..., -width:, :], x, x[..., :width, :]], dim=-2)


# --- x-direction (always local, periodic) two-point operators -------------------------


def _avg_fwd(a: torch.Tensor) -> torch.Tensor:
    """(a[i] + a[i+1]) / 2: centre -> u-point, v-point -> corner."""
    return 0.5 * (a + torch.roll(a, -1, dims=-1))


def _avg_bwd(a: torch.Tensor) -> torch.Tensor:
    """(a[i-1] + a[i]) / 2: u-point -> centre, corner -> v-point."""
    return 0.5 * (a + torch.roll(a, 1, dims=-1))


def _diff_fwd(a: torch.Tensor, d: float) -> torch.Tensor:
    """(a[i+1] - a[i]) / d: centre -> u-point, v-point -> corner."""
    return (torch.roll(a, -1, dims=-1) - a) / d


def _diff_bwd(a: torch.Tensor, d: float) -> torch.Tensor:
    """(a[i] - a[i-1]) / d: u-point -> centre, corner -> v-point."""
    return (a - torch.roll(a, 1, dims=-1)) / d


def _lap_x(a: torch.Tensor, d: float) -> torch.Tensor:
    return (torch.roll(a, -1, dims=-1) - 2.0 * a + torch.roll(a, 1, dims=-1)) / (d * d)


def _rows(a: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """Rows ``start .. start+count-1`` of ``a`` (dim ``-2``), a view."""
    return a.narrow(-2, start, count)


@dataclass(frozen=True)
class ShallowWater2D:
    r"""Nonlinear rotating shallow water on an ``ny x nx`` periodic C-grid (see module doc).

    Fields: ``nx, ny`` (cells along x and y), ``Lx, Ly`` (box size), ``g`` (gravity),
    ``f`` (Coriolis parameter), ``drag`` (linear drag :math:`r`), ``viscosity``
    (:math:`\nu`), ``dt`` (RK4 step).  The state is ``(..., 3, rows, nx)`` =
    ``(eta, u, v)`` with ``rows = ny`` for the whole grid or the local rows of a slab.
    """

    nx: int
    ny: int
    Lx: float
    Ly: float
    g: float = 9.81
    f: float = 1e-4
    drag: float = 0.0
    viscosity: float = 0.0
    dt: float = 1.0
    exchange: str = "stage"

    def __post_init__(self) -> None:
        if self.exchange not in ("stage", "step"):
            raise ValueError(f"exchange must be 'stage' (a halo of 1 row per RK4 stage) or "
                             f"'step' (4 rows once per step), got {self.exchange!r}")

    @property
    def dx(self) -> float:
        return self.Lx / self.nx

    @property
    def dy(self) -> float:
        return self.Ly / self.ny

    @property
    def cell_area(self) -> float:
        return self.dx * self.dy

    def halo(self) -> int:
        """Rows :meth:`step` asks ``pad`` for on each side: 1 per stage (``exchange="stage"``)
        or 4 once (``"step"``)."""
        return 4 * HALO if self.exchange == "step" else HALO

    def cfl(self, depth_max: Scalar) -> Scalar:
        r"""Gravity-wave CFL number :math:`\sqrt{gH_{\max}}\,\Delta t/\min(\Delta x, \Delta y)`."""
        c = torch.sqrt(self.g * depth_max) if torch.is_tensor(depth_max) else math.sqrt(
            self.g * depth_max)
        return c * self.dt / min(self.dx, self.dy)

    # --- coordinates -------------------------------------------------------------------

    def points(self, kind: str = "eta", j0: int = 0, rows: int | None = None, *,
               dtype: torch.dtype = torch.float64, device=None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(X, Y)``, each ``(rows, nx)``: coordinates of global rows ``j0 .. j0+rows-1``.

        ``kind`` is ``"eta"`` (cell centres, also ``depth``), ``"u"`` (east faces),
        ``"v"`` (north faces) or ``"q"`` (north-east corners).  ``rows`` defaults to
        ``ny - j0``.  Rows are not wrapped: ``Y`` may leave ``[0, Ly)`` for a slab that
        straddles the boundary; every initial condition here is periodic anyway.
        """
        offsets = {"eta": (0.5, 0.5), "u": (1.0, 0.5), "v": (0.5, 1.0), "q": (1.0, 1.0)}
        if kind not in offsets:
            raise ValueError(f"kind must be one of {sorted(offsets)}, got {kind!r}")
        ox, oy = offsets[kind]
        rows = self.ny - j0 if rows is None else rows
        i = torch.arange(self.nx, dtype=dtype, device=device)
        j = torch.arange(j0, j0 + rows, dtype=dtype, device=device)
        x = (i + ox) * self.dx
        y = (j + oy) * self.dy
        return x.expand(rows, self.nx), y[:, None].expand(rows, self.nx)

    def x_centres(self, j0: int = 0, rows: int | None = None, *,
                  dtype: torch.dtype = torch.float64, device=None) -> torch.Tensor:
        """x of the cell centres of rows ``j0 .. j0+rows-1``, shape ``(rows, nx)``."""
        return self.points("eta", j0, rows, dtype=dtype, device=device)[0]

    def y_centres(self, j0: int = 0, rows: int | None = None, *,
                  dtype: torch.dtype = torch.float64, device=None) -> torch.Tensor:
        """y of the cell centres of rows ``j0 .. j0+rows-1``, shape ``(rows, nx)``."""
        return self.points("eta", j0, rows, dtype=dtype, device=device)[1]

    # --- dynamics ----------------------------------------------------------------------

    def rhs(self, state: torch.Tensor, depth: torch.Tensor, pad: Pad = circular_pad
            ) -> torch.Tensor:
        """Tendency ``d state / dt``, shape of ``state`` broadcast with ``depth``.

        Calls ``pad`` exactly once, on the stacked ``(..., 4, rows, nx)`` tensor
        ``(eta, u, v, depth)`` with width :meth:`halo`, and then reads only the padded
        tensor.
        """
        if state.shape[-3] != 3 or state.shape[-1] != self.nx:
            raise ValueError(
                f"state must be (..., 3, rows, {self.nx}), got {tuple(state.shape)}")
        eta, u, v = state.unbind(-3)
        P = pad(torch.stack(torch.broadcast_tensors(eta, u, v, depth), dim=-3), HALO)
        n = state.shape[-2]
        if P.shape[-2] != n + 2 * HALO:
            raise ValueError(f"pad returned {P.shape[-2]} rows, expected {n + 2 * HALO}")
        return self.tendency(P)

    def tendency(self, P: torch.Tensor) -> torch.Tensor:
        """The tendency of the interior rows of a padded stack ``P`` of ``(eta, u, v,
        depth)``, ``(..., 4, m + 2, nx) -> (..., 3, m, nx)``: :meth:`rhs` without the pad."""
        n = P.shape[-2] - 2 * HALO
        eta_p, u_p, v_p, H_p = P.unbind(-3)  # padded row p is local row j = p - 1
        dx, dy, f, g = self.dx, self.dy, self.f, self.g

        h = H_p + eta_p                                   # centres, j = -1 .. n
        U = _avg_fwd(h) * u_p                             # u-points, j = -1 .. n
        h_v = 0.5 * (_rows(h, 0, n + 1) + _rows(h, 1, n + 1))   # v-points, j = -1 .. n-1
        v_l = _rows(v_p, 0, n + 1)
        V = h_v * v_l                                     # v-points, j = -1 .. n-1
        zeta = _diff_fwd(v_l, dx) - (_rows(u_p, 1, n + 1) - _rows(u_p, 0, n + 1)) / dy
        q = (f + zeta) / _avg_fwd(h_v)                    # corners, j = -1 .. n-1

        qVx = q * _avg_fwd(V)                             # corners, j = -1 .. n-1
        Uy = 0.5 * (_rows(U, 1, n) + _rows(U, 2, n))      # corners, j = 0 .. n-1
        qUy = _rows(q, 1, n) * Uy

        u2 = _rows(u_p, 1, n + 1) ** 2                    # u-points, j = 0 .. n
        v2 = v_p**2
        K = 0.5 * (_avg_bwd(u2) + 0.5 * (_rows(v2, 1, n + 1) + _rows(v2, 0, n + 1)))
        B = g * _rows(eta_p, 1, n + 1) + K                # centres, j = 0 .. n

        eta_t = -_diff_bwd(_rows(U, 1, n), dx) - (_rows(V, 1, n) - _rows(V, 0, n)) / dy
        u_t = 0.5 * (_rows(qVx, 1, n) + _rows(qVx, 0, n)) - _diff_fwd(_rows(B, 0, n), dx)
        v_t = -_avg_bwd(qUy) - (_rows(B, 1, n) - _rows(B, 0, n)) / dy

        u_c, v_c = _rows(u_p, 1, n), _rows(v_p, 1, n)
        if self.drag != 0.0:
            u_t = u_t - self.drag * u_c
            v_t = v_t - self.drag * v_c
        if self.viscosity != 0.0:
            nu = self.viscosity

            def lap(a_p: torch.Tensor, a_c: torch.Tensor) -> torch.Tensor:
                a_yy = (_rows(a_p, 2, n) - 2.0 * a_c + _rows(a_p, 0, n)) / (dy * dy)
                return _lap_x(a_c, dx) + a_yy

            u_t = u_t + nu * lap(u_p, u_c)
            v_t = v_t + nu * lap(v_p, v_c)
        return torch.stack([eta_t, u_t, v_t], dim=-3)

    def step(self, state: torch.Tensor, depth: torch.Tensor, pad: Pad = circular_pad
             ) -> torch.Tensor:
        """One RK4 step of size ``dt``: four :meth:`rhs` evaluations and four ``pad`` calls
        of width 1 (``exchange="stage"``), or one ``pad`` call of width 4
        (``exchange="step"``, :meth:`_step_wide`); the same numbers either way."""
        if self.exchange == "step":
            return self._step_wide(state, depth, pad)
        return rk4(lambda s: self.rhs(s, depth, pad), state, self.dt)

    def _step_wide(self, state: torch.Tensor, depth: torch.Tensor, pad: Pad) -> torch.Tensor:
        """RK4 with one halo of ``4 * HALO`` rows per step (communication-avoiding): stage
        ``k`` is computed on the local rows plus ``4 - k`` halo rows on each side, each stage
        consuming one, so the stages need no exchange of their own. Every element goes
        through the operations of :func:`~deepsolve.physics.time_stepping.rk4` in the same
        order: the result equals :meth:`step` with ``exchange="stage"`` to the last bit."""
        if state.shape[-3] != 3 or state.shape[-1] != self.nx:
            raise ValueError(
                f"state must be (..., 3, rows, {self.nx}), got {tuple(state.shape)}")
        n, w = state.shape[-2], 4 * HALO
        eta, u, v = state.unbind(-3)
        P = pad(torch.stack(torch.broadcast_tensors(eta, u, v, depth), dim=-3), w)
        if P.shape[-2] != n + 2 * w:
            raise ValueError(f"pad returned {P.shape[-2]} rows, expected {n + 2 * w}")
        S, D = P[..., :3, :, :], P[..., 3:, :, :]
        dt = self.dt

        def rows(a: torch.Tensor, k: int) -> torch.Tensor:   # drop k rows on each side
            return a.narrow(-2, k, a.shape[-2] - 2 * k)

        def T(s: torch.Tensor, k: int) -> torch.Tensor:      # s has n + 2 (w - k) rows
            return self.tendency(torch.cat([s, rows(D, k)], dim=-3))

        k1 = T(S, 0)                                          # n + 6 rows
        k2 = T(rows(S, 1) + (0.5 * dt) * k1, 1)              # n + 4
        k3 = T(rows(S, 2) + (0.5 * dt) * k2, 2)              # n + 2
        k4 = T(rows(S, 3) + dt * k3, 3)                       # n
        return rows(S, 4) + (dt / 6.0) * (rows(k1, 3) + 2.0 * (rows(k2, 2) + rows(k3, 1)) + k4)

    def advance(self, state: torch.Tensor, depth: torch.Tensor, n_steps: int,
                pad: Pad = circular_pad) -> torch.Tensor:
        """Apply :meth:`step` ``n_steps`` times."""
        for _ in range(int(n_steps)):
            state = self.step(state, depth, pad)
        return state

    def __call__(self, state: torch.Tensor, depth: torch.Tensor, pad: Pad = circular_pad
                 ) -> torch.Tensor:
        """:meth:`step`."""
        return self.step(state, depth, pad)


# --- diagnostics ---------------------------------------------------------------------------


def mass(state: torch.Tensor, depth: torch.Tensor, grid: ShallowWater2D) -> torch.Tensor:
    r""":math:`\sum_{j,i} (H + \eta)\,\Delta x\Delta y` over the given rows, shape ``(...)``.

    Exactly conserved (to round-off) on the whole periodic grid; slabs' masses add up.
    """
    return ((depth + state[..., 0, :, :]) * grid.cell_area).sum(dim=(-2, -1))


def energy(state: torch.Tensor, depth: torch.Tensor, grid: ShallowWater2D,
           pad: Pad = circular_pad) -> torch.Tensor:
    r"""Total energy over the given rows, shape ``(...)``:

    .. math::

        E = \sum_{\text{centres}} \bigl[\tfrac12 h\,(\overline{u^2}^x + \overline{v^2}^y)
            + \tfrac12 g\eta^2\bigr]\Delta x\Delta y,\qquad h = H + \eta,

    the energy that the semi-discrete scheme conserves for ``drag = viscosity = 0`` (see
    the module docstring; :math:`\overline{v^2}^y` at row ``j`` uses ``v`` of row ``j-1``,
    obtained with one call ``pad(v, 1)``, so slabs' energies add up to the global one).
    """
    eta, u, v = state.unbind(-3)
    n = state.shape[-2]
    v2 = pad(v, HALO) ** 2
    K = 0.5 * (_avg_bwd(u * u) + 0.5 * (_rows(v2, 1, n) + _rows(v2, 0, n)))
    dens = (depth + eta) * K + 0.5 * grid.g * eta * eta
    return (dens * grid.cell_area).sum(dim=(-2, -1))


# --- initial conditions and exact solutions --------------------------------------------


def gaussian_bump(grid: ShallowWater2D, amplitude: float = 1.0, width: float | None = None,
                  x0: float | None = None, y0: float | None = None, j0: int = 0,
                  rows: int | None = None, *, dtype: torch.dtype = torch.float64,
                  device=None) -> torch.Tensor:
    r"""Periodic Gaussian bump at cell centres of rows ``j0 .. j0+rows-1``, ``(rows, nx)``.

    :math:`A\exp\bigl(\frac{\cos(2\pi(x-x_0)/L_x) - 1}{(2\pi\sigma/L_x)^2}
    + \frac{\cos(2\pi(y-y_0)/L_y) - 1}{(2\pi\sigma/L_y)^2}\bigr)`: the periodic (von
    Mises) form of :math:`A e^{-r^2/2\sigma^2}`, smooth and exactly periodic, and within
    :math:`O((\sigma/L)^2)` of the Gaussian for :math:`\sigma \ll L`.  Defaults: centre
    of the box, ``width = min(Lx, Ly) / 10``.  Use it for ``eta`` or a depth anomaly.
    """
    width = min(grid.Lx, grid.Ly) / 10 if width is None else width
    x0 = grid.Lx / 2 if x0 is None else x0
    y0 = grid.Ly / 2 if y0 is None else y0
    X, Y = grid.points("eta", j0, rows, dtype=dtype, device=device)
    ax, ay = 2 * math.pi / grid.Lx, 2 * math.pi / grid.Ly
    arg = (torch.cos(ax * (X - x0)) - 1) / (ax * width) ** 2 + (
        torch.cos(ay * (Y - y0)) - 1) / (ay * width) ** 2
    return amplitude * torch.exp(arg)


def _cs(grid: ShallowWater2D, mode: int) -> tuple[float, float, float]:
    k = 2 * math.pi * mode / grid.Lx
    return k, math.cos(k * grid.dx / 2), 2 * math.sin(k * grid.dx / 2) / grid.dx


def inertia_gravity_frequency(grid: ShallowWater2D, depth: float, mode: int = 1) -> float:
    r"""Discrete frequency :math:`\omega = \sqrt{f^2c^2 + gHs^2}` of x-mode ``mode``
    (:math:`k = 2\pi\,\text{mode}/L_x`, flat depth ``H``) of the linearised scheme."""
    _, c, s = _cs(grid, mode)
    return math.sqrt(grid.f**2 * c**2 + grid.g * depth * s**2)


def inertia_gravity_exact(grid: ShallowWater2D, depth: float, t: float, mode: int = 1,
                          amplitudes: tuple[complex, complex, complex] = (1.0, 0.0, 0.0),
                          j0: int = 0, rows: int | None = None, *,
                          dtype: torch.dtype = torch.float64, device=None) -> torch.Tensor:
    r"""Exact solution at time ``t`` of the scheme *linearised about rest* (flat ``depth``,
    semi-discrete in time) for one x-Fourier mode; state ``(3, rows, nx)``.

    Each field is :math:`\mathrm{Re}(a(t)\,e^{ikx})` at its own points
    (:math:`k = 2\pi\,\text{mode}/L_x`, uniform in y), with initial complex amplitudes
    ``amplitudes = (eta, u, v)`` and :math:`a(t) = e^{Mt}a(0)`,

    .. math::

        M = \begin{pmatrix} 0 & -H\,is & 0\\ -g\,is & 0 & fc\\ 0 & -fc & 0\end{pmatrix},
        \qquad c = \cos\tfrac{k\Delta x}{2},\ s = \tfrac{2}{\Delta x}\sin\tfrac{k\Delta x}{2}

    (eigenvalues :math:`0, \pm i\omega`, :func:`inertia_gravity_frequency`).  The
    nonlinear solver with amplitude :math:`A` differs by :math:`O(A/H)` relative, RK4 by
    :math:`O((\omega\Delta t)^4)` per unit :math:`\omega t`.
    """
    _, c, s = _cs(grid, mode)
    H, f, g = float(depth), grid.f, grid.g
    M = torch.tensor([[0, -1j * H * s, 0], [-1j * g * s, 0, f * c], [0, -f * c, 0]],
                     dtype=torch.complex128)
    a = torch.linalg.matrix_exp(M * t) @ torch.tensor(amplitudes, dtype=torch.complex128)
    k = 2 * math.pi * mode / grid.Lx
    out = []
    for kind, amp in zip(("eta", "u", "eta"), a, strict=True):  # v shares x with centres
        X = grid.points(kind, j0, rows, dtype=torch.float64)[0]
        out.append(amp.real * torch.cos(k * X) - amp.imag * torch.sin(k * X))
    return torch.stack(out).to(dtype=dtype, device=device)


def geostrophic_state(grid: ShallowWater2D, eta_x: torch.Tensor, rows: int | None = None
                      ) -> torch.Tensor:
    r"""Discrete linear geostrophic state for an elevation ``eta_x`` varying only in x.

    ``eta_x`` has shape ``(..., nx)`` (cell centres of one row); returns the state
    ``(..., 3, rows, nx)`` (``rows`` defaults to ``ny``) with ``eta`` = ``eta_x`` on every
    row, ``u = 0`` and ``v`` solving the discrete balance :math:`f\,\overline{v}^x =
    g\,\delta_x\eta` at u-points, i.e. per x-mode :math:`\hat v = (g/f)\,(is/c)\,\hat\eta`
    (for :math:`\eta = A\cos kx`: :math:`v = -\frac{g s A}{f c}\sin kx`).  It is an exact
    steady state of the linearised scheme for any (flat) depth; the nonlinear scheme
    drifts by :math:`O(A/H)` relative.  The mean and (for even ``nx``) Nyquist parts of
    ``v`` are zero (the Nyquist part of ``eta`` cannot be balanced; leave it out).
    """
    nx = grid.nx
    rows = grid.ny if rows is None else rows
    m = torch.arange(nx // 2 + 1, dtype=torch.float64, device=eta_x.device)
    half = math.pi * m / nx                      # k dx / 2
    c = torch.cos(half)
    s = 2 * torch.sin(half) / grid.dx
    ratio = torch.where(c.abs() > 1e-12, s / torch.where(c.abs() > 1e-12, c, 1.0), 0.0)
    ratio[0] = 0.0
    if nx % 2 == 0:
        ratio[-1] = 0.0
    mult = (1j * grid.g / grid.f) * ratio
    v_x = torch.fft.irfft(torch.fft.rfft(eta_x.to(torch.float64)) * mult, n=nx)
    v_x = v_x.to(eta_x.dtype)
    shape = (*eta_x.shape[:-1], rows, nx)
    eta = eta_x[..., None, :].expand(shape)
    return torch.stack([eta, torch.zeros_like(eta), v_x[..., None, :].expand(shape)], dim=-3)
