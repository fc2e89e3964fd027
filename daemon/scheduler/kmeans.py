"""One-dimensional K-means with an elbow rule (torch-free, deterministic).

Used by the MLQ policy to choose how many queues there are and where their
WRS cut-offs lie (Chameleon §4.2): cluster recent request sizes for K = 1..K_max,
keep the K after which one more cluster stops paying (WCSS elbow), and cut
between neighbouring centroids.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Clustering:
    centroids: tuple[float, ...]  # ascending
    wcss: tuple[float, ...]  # within-cluster sum of squares for K = 1, 2, ... (as far as computed)

    @property
    def k(self) -> int:
        return len(self.centroids)

    @property
    def cutoffs(self) -> tuple[float, ...]:
        """Boundaries between clusters: midpoints of neighbouring centroids."""
        c = self.centroids
        return tuple((c[i] + c[i + 1]) / 2 for i in range(len(c) - 1))


def kmeans_1d(values: list[float], k: int, *, iterations: int = 64,
              seeds: tuple[float, ...] | None = None) -> tuple[tuple[float, ...], float]:
    """Lloyd's algorithm on sorted values from quantile seeds (or `seeds`); (centroids ascending,
    WCSS). Empty clusters are dropped, so fewer than k centroids may come back."""
    if not values:
        raise ValueError("kmeans_1d needs at least one value")
    xs = sorted(values)
    n = len(xs)
    k = max(1, min(k, len(set(xs))))
    if seeds is not None:
        centroids = sorted(set(seeds))
    else:
        centroids = sorted({xs[min(n - 1, int((i + 0.5) * n / k))] for i in range(k)})
    # Prefix sums make each cluster's mean and SSE O(1) once its index range is known.
    pre = [0.0]
    pre2 = [0.0]
    for x in xs:
        pre.append(pre[-1] + x)
        pre2.append(pre2[-1] + x * x)
    bounds: list[int] = []
    for _ in range(iterations):
        cuts = [(centroids[i] + centroids[i + 1]) / 2 for i in range(len(centroids) - 1)]
        new_bounds = [0] + [bisect.bisect_right(xs, c) for c in cuts] + [n]
        new_centroids = []
        for lo, hi in zip(new_bounds, new_bounds[1:]):
            if hi > lo:
                new_centroids.append((pre[hi] - pre[lo]) / (hi - lo))
        if new_bounds == bounds and new_centroids == centroids:
            break
        bounds, centroids = new_bounds, new_centroids
    wcss = 0.0
    for lo, hi in zip(bounds, bounds[1:]):
        if hi > lo:
            s, s2, m = pre[hi] - pre[lo], pre2[hi] - pre2[lo], hi - lo
            wcss += max(0.0, s2 - s * s / m)
    return tuple(centroids), wcss


def choose_clusters(values: list[float], k_max: int, *, min_gain: float = 0.5, min_total_gain: float = 0.01,
                    min_ratio: float = 1.5) -> Clustering:
    """The elbow of the WCSS curve, capped at k_max: K grows while one more cluster removes
    at least `min_gain` of the current WCSS and at least `min_total_gain` of the total, and
    neighbouring centroids stay `min_ratio` apart (sizes within that factor are one class;
    values are non-negative request sizes)."""
    if k_max < 1:
        raise ValueError("k_max must be >= 1")
    best, total = kmeans_1d(values, 1)
    curve = [total]
    if total <= 0.0:
        return Clustering(best, tuple(curve))
    for k in range(2, k_max + 1):
        centroids, wcss = kmeans_1d(values, k)
        if wcss > curve[-1]:  # quantile seeds found a worse local optimum: split the K-1 solution instead
            centroids, wcss = min((centroids, wcss), _grown(values, best), key=lambda fit: fit[1])
        gain = curve[-1] - wcss
        close = any(hi < min_ratio * lo for lo, hi in zip(centroids, centroids[1:]))
        if len(centroids) < k:
            break  # the seeds collapsed onto fewer clusters: that WCSS is not one of K clusters
        if gain < min_gain * curve[-1] or gain < min_total_gain * total or close:
            curve.append(wcss)
            break
        curve.append(wcss)
        best = centroids
    return Clustering(best, tuple(curve))


def _grown(values: list[float], centroids: tuple[float, ...]) -> tuple[tuple[float, ...], float]:
    """K-means seeded with `centroids` plus the value farthest from its centroid: Lloyd's
    steps never raise WCSS, so the result is at most the previous solution's WCSS."""
    farthest = max(values, key=lambda x: min(abs(x - c) for c in centroids))
    return kmeans_1d(values, len(centroids) + 1, seeds=(*centroids, farthest))
