//! SVG charts of copse's own measurements (plotters' SVG backend). Published
//! figures of other projects never go through here.

use plotters::coord::ranged1d::{SegmentValue, SegmentedCoord};
use plotters::prelude::*;

/// One horizontal bar: a label, its p50 (bar) and p95 (whisker).
pub struct Bar {
    pub label: String,
    pub p50: f64,
    pub p95: f64,
}

const BAR: RGBColor = RGBColor(46, 125, 50);
const WHISKER: RGBColor = RGBColor(30, 30, 30);

/// p50 bars with p95 whiskers, one row per scenario (the first on top); a
/// log axis when the values span more than two decades.
pub fn bars(caption: &str, unit: &str, rows: &[Bar]) -> anyhow::Result<String> {
    // plotters counts rows from the bottom.
    let rows: Vec<&Bar> = rows.iter().rev().collect();
    let rows = rows.as_slice();
    let n = rows.len().max(1);
    // Room for the caption and axis whatever the row count; one row alone
    // would otherwise get less height than its bar margins.
    let height = 90 + 26 * n as u32;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (760, height)).into_drawing_area();
        root.fill(&WHITE)?;
        let lo = rows.iter().map(|r| r.p50).filter(|v| *v > 0.0).fold(f64::INFINITY, f64::min);
        let hi = rows.iter().map(|r| r.p95.max(r.p50)).fold(0.0, f64::max);
        let (lo, hi) = if lo.is_finite() && hi > 0.0 { (lo, hi) } else { (0.1, 1.0) };
        let labels: Vec<String> = rows.iter().map(|r| r.label.clone()).collect();
        let fmt = |v: &SegmentValue<usize>| match v {
            SegmentValue::CenterOf(i) | SegmentValue::Exact(i) => labels.get(*i).cloned().unwrap_or_default(),
            SegmentValue::Last => String::new(),
        };
        let mut b = ChartBuilder::on(&root);
        b.caption(caption, ("sans-serif", 15)).margin(8).x_label_area_size(34).y_label_area_size(190);
        if hi / lo > 100.0 {
            let mut chart = b.build_cartesian_2d((lo / 2.0..hi * 1.5).log_scale(), (0..rows.len()).into_segmented())?;
            chart
                .configure_mesh()
                .label_style(("sans-serif", 12))
                .axis_desc_style(("sans-serif", 12))
                .x_desc(unit)
                .y_label_formatter(&fmt)
                .y_labels(n)
                .disable_y_mesh()
                .draw()?;
            draw_bars(&mut chart, rows, lo / 2.0)?;
        } else {
            let mut chart = b.build_cartesian_2d(0.0..hi * 1.1, (0..rows.len()).into_segmented())?;
            chart
                .configure_mesh()
                .label_style(("sans-serif", 12))
                .axis_desc_style(("sans-serif", 12))
                .x_desc(unit)
                .y_label_formatter(&fmt)
                .y_labels(n)
                .disable_y_mesh()
                .draw()?;
            draw_bars(&mut chart, rows, 0.0)?;
        }
        root.present()?;
    }
    Ok(svg)
}

fn draw_bars<X>(
    chart: &mut ChartContext<
        '_,
        SVGBackend<'_>,
        Cartesian2d<X, SegmentedCoord<plotters::coord::types::RangedCoordusize>>,
    >,
    rows: &[&Bar],
    base: f64,
) -> anyhow::Result<()>
where
    X: Ranged<ValueType = f64>,
{
    chart.draw_series(rows.iter().enumerate().map(|(i, r)| {
        let mut rect =
            Rectangle::new([(base, SegmentValue::Exact(i)), (r.p50, SegmentValue::Exact(i + 1))], BAR.filled());
        rect.set_margin(4, 4, 0, 0);
        rect
    }))?;
    chart.draw_series(rows.iter().enumerate().map(|(i, r)| {
        PathElement::new(
            vec![(r.p50, SegmentValue::CenterOf(i)), (r.p95, SegmentValue::CenterOf(i))],
            WHISKER.stroke_width(2),
        )
    }))?;
    Ok(())
}

/// Lines over a numeric x axis (e.g. MiB per sandbox against sandboxes alive).
pub fn lines(
    caption: &str,
    x_desc: &str,
    y_desc: &str,
    series: &[(String, Vec<(f64, f64)>)],
) -> anyhow::Result<String> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (760, 340)).into_drawing_area();
        root.fill(&WHITE)?;
        let pts = series.iter().flat_map(|(_, p)| p.iter());
        let (xmax, ymax) = pts.fold((1.0f64, 1.0f64), |(x, y), p| (x.max(p.0), y.max(p.1)));
        let mut chart = ChartBuilder::on(&root)
            .caption(caption, ("sans-serif", 15))
            .margin(8)
            .x_label_area_size(34)
            .y_label_area_size(60)
            .build_cartesian_2d(0.0..xmax * 1.05, 0.0..ymax * 1.15)?;
        chart
            .configure_mesh()
            .label_style(("sans-serif", 12))
            .axis_desc_style(("sans-serif", 12))
            .x_desc(x_desc)
            .y_desc(y_desc)
            .draw()?;
        for (i, (name, p)) in series.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            chart
                .draw_series(LineSeries::new(p.iter().copied(), color.stroke_width(2)))?
                .label(name.clone())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2)));
            chart.draw_series(p.iter().map(|&(x, y)| Circle::new((x, y), 3, color.filled())))?;
        }
        chart
            .configure_series_labels()
            .label_font(("sans-serif", 12))
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()?;
        root.present()?;
    }
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bar_chart_is_svg_with_one_rect_per_row() {
        let rows =
            vec![Bar { label: "a".into(), p50: 1.0, p95: 2.0 }, Bar { label: "b".into(), p50: 500.0, p95: 900.0 }];
        let svg = bars("t", "ms", &rows).unwrap();
        assert!(svg.starts_with("<svg"));
        assert!(svg.contains("\na\n") && svg.contains("\nb\n"));
        assert_eq!(svg.matches("<rect").count(), 3, "background and one bar per row");
    }

    #[test]
    fn line_chart_has_legend() {
        let svg = lines("t", "x", "y", &[("base".into(), vec![(100.0, 5.0), (300.0, 6.0)])]).unwrap();
        assert!(svg.contains("\nbase\n"));
    }
}
