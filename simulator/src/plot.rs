//! SVG plots with plotters (SVG backend only, no font files needed): latency
//! CDFs per policy on a log axis, and time series (queue length, KV usage).
//! Series are thinned to at most [`MAX_POINTS`] points so files stay small.

use crate::error::SimError;
use plotters::prelude::*;
use std::path::Path;

/// Most points drawn per series.
pub const MAX_POINTS: usize = 1000;
const SIZE: (u32, u32) = (900, 560);

fn plot_err(path: &Path, e: impl std::fmt::Display) -> SimError {
    SimError::Plot {
        path: path.to_path_buf(),
        message: e.to_string(),
    }
}

/// Points of the empirical CDF of `values` (sorted in place), at most `MAX_POINTS`.
pub fn cdf_points(values: &mut [f64]) -> Vec<(f64, f64)> {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    if n == 0 {
        return Vec::new();
    }
    let step = n.div_ceil(MAX_POINTS).max(1);
    let mut pts: Vec<(f64, f64)> = (0..n)
        .step_by(step)
        .map(|i| (values[i], (i + 1) as f64 / n as f64))
        .collect();
    if pts.last().is_some_and(|p| p.1 < 1.0) {
        pts.push((values[n - 1], 1.0));
    }
    pts
}

/// Thins a time series to at most `MAX_POINTS` points, keeping the maximum of
/// each bucket so peaks stay visible.
pub fn thin_series(points: &[(f64, f64)]) -> Vec<(f64, f64)> {
    let step = points.len().div_ceil(MAX_POINTS).max(1);
    points
        .chunks(step)
        .filter_map(|c| {
            let t = c.first()?.0;
            let y = c.iter().map(|p| p.1).fold(f64::NEG_INFINITY, f64::max);
            Some((t, y))
        })
        .collect()
}

/// The log x axis of a CDF plot: the positive latencies with a margin; a factor of 2 either
/// side of a single distinct value; 0.1–10 ms when there is none.
fn cdf_axis(series: &[(String, Vec<(f64, f64)>)]) -> (f64, f64) {
    let xs = series
        .iter()
        .flat_map(|(_, p)| p.iter().map(|q| q.0))
        .filter(|x| *x > 0.0 && x.is_finite());
    let (lo, hi) = xs.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), x| {
        (a.min(x), b.max(x))
    });
    if !lo.is_finite() {
        (0.1, 10.0)
    } else if hi > lo {
        (lo * 0.9, hi * 1.1)
    } else {
        (lo * 0.5, lo * 2.0)
    }
}

/// Draws CDFs of latencies (ms) for each labelled series on a log x axis.
pub fn plot_cdfs(
    path: &Path,
    title: &str,
    series: &[(String, Vec<(f64, f64)>)],
) -> Result<(), SimError> {
    let (lo, hi) = cdf_axis(series);
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(|e| plot_err(path, e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d((lo..hi).log_scale(), 0.0..1.0)
        .map_err(|e| plot_err(path, e))?;
    chart
        .configure_mesh()
        .x_desc("latency (ms, log scale)")
        .y_desc("fraction of requests")
        .draw()
        .map_err(|e| plot_err(path, e))?;
    for (i, (label, pts)) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let pts: Vec<(f64, f64)> = pts.iter().copied().filter(|p| p.0 > 0.0).collect();
        chart
            .draw_series(LineSeries::new(pts, color.stroke_width(2)))
            .map_err(|e| plot_err(path, e))?
            .label(label.as_str())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
    }
    finish(chart, root, path, SeriesLabelPosition::LowerRight)
}

/// Draws time series `(t_s, y)` for each labelled series.
pub fn plot_series(
    path: &Path,
    title: &str,
    y_desc: &str,
    series: &[(String, Vec<(f64, f64)>)],
) -> Result<(), SimError> {
    let all = series.iter().flat_map(|(_, p)| p.iter());
    let (t_max, y_max) = all.fold((0.0f64, 0.0f64), |(t, y), p| (t.max(p.0), y.max(p.1)));
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(|e| plot_err(path, e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..t_max.max(1e-3), 0.0..(y_max * 1.05).max(1e-3))
        .map_err(|e| plot_err(path, e))?;
    chart
        .configure_mesh()
        .x_desc("virtual time (s)")
        .y_desc(y_desc)
        .draw()
        .map_err(|e| plot_err(path, e))?;
    for (i, (label, pts)) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(thin_series(pts), color.stroke_width(1)))
            .map_err(|e| plot_err(path, e))?
            .label(label.as_str())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
    }
    finish(chart, root, path, SeriesLabelPosition::UpperRight)
}

fn finish<'a, X, Y>(
    mut chart: ChartContext<'a, SVGBackend<'a>, Cartesian2d<X, Y>>,
    root: DrawingArea<SVGBackend<'a>, plotters::coord::Shift>,
    path: &Path,
    legend: SeriesLabelPosition,
) -> Result<(), SimError>
where
    X: Ranged<ValueType = f64>,
    Y: Ranged<ValueType = f64>,
{
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(legend)
        .draw()
        .map_err(|e| plot_err(path, e))?;
    root.present().map_err(|e| plot_err(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cdf_points_end_at_one_and_are_thinned() {
        let mut v: Vec<f64> = (0..5000).map(f64::from).rev().collect();
        let pts = cdf_points(&mut v);
        assert!(pts.len() <= MAX_POINTS + 1);
        assert_eq!(pts[0], (0.0, 1.0 / 5000.0));
        assert_eq!(*pts.last().unwrap(), (4999.0, 1.0));
        assert!(pts.windows(2).all(|w| w[0].0 <= w[1].0 && w[0].1 < w[1].1));
        assert!(cdf_points(&mut []).is_empty());
    }

    #[test]
    fn thinning_keeps_peaks() {
        let mut s: Vec<(f64, f64)> = (0..10_000).map(|i| (f64::from(i), 0.0)).collect();
        s[4321].1 = 9.0;
        let t = thin_series(&s);
        assert!(t.len() <= MAX_POINTS);
        assert!(t.iter().any(|p| p.1 == 9.0));
    }

    #[test]
    fn cdf_axis_holds_a_single_latency() {
        let one = |mut v: Vec<f64>| vec![("x".to_string(), cdf_points(&mut v))];
        // One distinct value far from 0.1-10 ms: the axis is centred on it.
        let (lo, hi) = cdf_axis(&one(vec![250.0, 250.0, 250.0]));
        assert!(lo < 250.0 && 250.0 < hi, "{lo}..{hi}");
        assert_eq!((lo, hi), (125.0, 500.0));
        let (lo, hi) = cdf_axis(&one(vec![0.002]));
        assert!(lo < 0.002 && 0.002 < hi, "{lo}..{hi}");
        let (lo, hi) = cdf_axis(&one(vec![2.0, 40.0]));
        assert!(lo < 2.0 && 40.0 < hi, "{lo}..{hi}");
        assert_eq!(cdf_axis(&one(vec![])), (0.1, 10.0));
        assert_eq!(cdf_axis(&one(vec![0.0])), (0.1, 10.0));
    }

    #[test]
    fn writes_svg_files() {
        let dir = std::env::temp_dir().join(format!("sy-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut a: Vec<f64> = (1..200).map(f64::from).collect();
        let series = vec![("fcfs".to_string(), cdf_points(&mut a))];
        let p = dir.join("cdf.svg");
        plot_cdfs(&p, "TTFT", &series).unwrap();
        let text = std::fs::read_to_string(&p).unwrap();
        assert!(text.starts_with("<svg") && text.contains("fcfs"));
        let q = dir.join("q.svg");
        plot_series(
            &q,
            "queue",
            "requests",
            &[("x".into(), vec![(0.0, 1.0), (2.0, 3.0)])],
        )
        .unwrap();
        assert!(std::fs::read_to_string(&q).unwrap().contains("<polyline"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
