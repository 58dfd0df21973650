//! SVG plots with plotters (SVG backend only, no font files needed): latency
//! CDFs per policy on a log axis, optionally with a target marked as a vertical line (a
//! tier's TTFT or TPOT target), and time series (queue length, KV usage).
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

/// The colour of a target line (the series take theirs from `Palette99`, which has no black).
pub const TARGET_COLOR: RGBColor = BLACK;

/// A latency to mark on a CDF plot: a vertical line at `ms`, labelled `label` in the legend
/// and beside its top.
#[derive(Clone, Debug, PartialEq)]
pub struct Target {
    /// Where, in ms.
    pub ms: f64,
    /// What it is, e.g. "target 200 ms".
    pub label: String,
}

/// [`cdf_axis`] widened to hold `target` with the same margin.
fn cdf_axis_with(series: &[(String, Vec<(f64, f64)>)], target: Option<f64>) -> (f64, f64) {
    let (lo, hi) = cdf_axis(series);
    match target.filter(|t| *t > 0.0 && t.is_finite()) {
        Some(t) => (lo.min(t * 0.9), hi.max(t * 1.1)),
        None => (lo, hi),
    }
}

/// Draws CDFs of latencies (ms) for each labelled series on a log x axis.
pub fn plot_cdfs(
    path: &Path,
    title: &str,
    series: &[(String, Vec<(f64, f64)>)],
) -> Result<(), SimError> {
    plot_cdfs_with_target(path, title, series, None)
}

/// [`plot_cdfs`] with `target` (if any, and positive) drawn as a black vertical line across
/// the plot, within the x axis, so a curve left of it at a height meets it for that share.
pub fn plot_cdfs_with_target(
    path: &Path,
    title: &str,
    series: &[(String, Vec<(f64, f64)>)],
    target: Option<&Target>,
) -> Result<(), SimError> {
    let target = target.filter(|t| t.ms > 0.0 && t.ms.is_finite());
    let (lo, hi) = cdf_axis_with(series, target.map(|t| t.ms));
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
    if let Some(t) = target {
        let style = TARGET_COLOR.stroke_width(2);
        chart
            .draw_series(LineSeries::new(vec![(t.ms, 0.0), (t.ms, 1.0)], style))
            .map_err(|e| plot_err(path, e))?
            .label(t.label.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], style));
        chart
            .draw_series(std::iter::once(
                // 5 pixels right of the line's top.
                EmptyElement::at((t.ms, 0.97))
                    + Text::new(
                        t.label.clone(),
                        (5, 0),
                        ("sans-serif", 14).into_font().color(&TARGET_COLOR),
                    ),
            ))
            .map_err(|e| plot_err(path, e))?;
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

    /// The polylines of an SVG plotters wrote: (stroke colour and width, points).
    fn polylines(svg: &str) -> Vec<(String, Vec<(i32, i32)>)> {
        let attr = |tag: &str, name: &str| -> String {
            let start = tag.find(&format!(" {name}=\"")).unwrap() + name.len() + 3;
            tag[start..].split('"').next().unwrap().to_string()
        };
        svg.split("<polyline")
            .skip(1)
            .map(|rest| {
                let tag = rest.split("/>").next().unwrap();
                let points = attr(tag, "points")
                    .split_whitespace()
                    .map(|p| {
                        let (x, y) = p.split_once(',').unwrap();
                        (x.parse().unwrap(), y.parse().unwrap())
                    })
                    .collect();
                let stroke = format!("{} {}", attr(tag, "stroke"), attr(tag, "stroke-width"));
                (stroke, points)
            })
            .collect()
    }

    #[test]
    fn a_target_is_a_vertical_line_where_the_curves_reach_its_latency() {
        let dir = crate::scratch::ScratchDir::new("plot-target");
        // fcfs has a request at exactly the 200 ms target; slo-aware's are all below 100.
        let series = vec![
            ("fcfs".to_string(), cdf_points(&mut [100.0, 200.0, 400.0])),
            ("slo-aware".to_string(), cdf_points(&mut [20.0, 40.0, 80.0])),
        ];
        let target = Target {
            ms: 200.0,
            label: "ttft target 200 ms".into(),
        };
        let p = dir.join("tier.svg");
        plot_cdfs_with_target(&p, "Tier \"premium\"", &series, Some(&target)).unwrap();
        let svg = std::fs::read_to_string(&p).unwrap();
        assert!(svg.contains("ttft target 200 ms"), "the label is shown");
        assert!(
            svg.contains("fcfs") && svg.contains("slo-aware"),
            "a legend entry each"
        );
        let lines = polylines(&svg);
        // The axes and ticks are black too, 1 pixel wide.
        let black = format!("{} 2", make_color(&TARGET_COLOR));
        // The target: one vertical black line 2 pixels wide, from y = 0 to y = 1 (the
        // legend's sample of it is horizontal).
        let vertical: Vec<&Vec<(i32, i32)>> = lines
            .iter()
            .filter(|(c, pts)| *c == black && pts.len() == 2 && pts[0].0 == pts[1].0)
            .map(|(_, pts)| pts)
            .collect();
        assert_eq!(vertical.len(), 1, "{lines:?}");
        let x = vertical[0][0].0;
        // fcfs's curve passes through (200 ms, 2/3): its second point sits on the line.
        let fcfs = &lines
            .iter()
            .find(|(c, pts)| {
                *c == format!("{} 2", make_color(&Palette99::pick(0))) && pts.len() == 3
            })
            .expect("fcfs's curve")
            .1;
        assert_eq!(fcfs[1].0, x, "{fcfs:?} against x = {x}");
        assert!(fcfs[0].0 < x && x < fcfs[2].0);
        // slo-aware's curve lies wholly left of it: it meets the target for every request.
        let slo = &lines
            .iter()
            .find(|(c, pts)| {
                *c == format!("{} 2", make_color(&Palette99::pick(1))) && pts.len() == 3
            })
            .expect("slo-aware's curve")
            .1;
        assert!(slo.iter().all(|pt| pt.0 < x), "{slo:?}");
        // The line spans the plot: its ends are the curves' heights of 0 and 1.
        let (top, bottom) = (
            vertical[0][0].1.min(vertical[0][1].1),
            vertical[0][0].1.max(vertical[0][1].1),
        );
        assert_eq!(fcfs[2].1, top);
        assert!(bottom > fcfs[0].1);
        // A target beyond every latency widens the axis to show it.
        let far = Target {
            ms: 5000.0,
            label: "tpot target 5000 ms".into(),
        };
        plot_cdfs_with_target(&p, "far", &series, Some(&far)).unwrap();
        let lines = polylines(&std::fs::read_to_string(&p).unwrap());
        let far_x = lines
            .iter()
            .find(|(c, pts)| *c == black && pts.len() == 2 && pts[0].0 == pts[1].0)
            .expect("the far target's line")
            .1[0]
            .0;
        let curves = lines.iter().filter(|(c, p)| *c != black && p.len() == 3);
        assert_eq!(curves.clone().count(), 2);
        assert!(curves
            .clone()
            .all(|(_, pts)| pts.iter().all(|pt| pt.0 < far_x)));
        assert!(f64::from(far_x) < f64::from(SIZE.0));
        // Without a target, no black line.
        plot_cdfs_with_target(&p, "none", &series, None).unwrap();
        let lines = polylines(&std::fs::read_to_string(&p).unwrap());
        assert!(lines.iter().all(|(c, _)| *c != black));
    }

    /// `#rrggbb`, as the SVG backend writes a colour.
    fn make_color(c: &impl Color) -> String {
        let (r, g, b) = c.to_rgba().rgb();
        format!("#{r:02X}{g:02X}{b:02X}")
    }

    #[test]
    fn writes_svg_files() {
        let dir = crate::scratch::ScratchDir::new("plot");
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
    }
}
