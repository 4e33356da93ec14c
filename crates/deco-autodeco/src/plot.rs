//! SVG line charts of loss curves and decoding traces (plotters).

use plotters::prelude::*;

use crate::error::{Error, Result};

/// One named series of `(x, y)` points.
pub type Series<'a> = (&'a str, Vec<(f64, f64)>);

/// Draws `series` as lines in one chart and writes it to `path` (SVG) atomically. Non-finite
/// points are skipped.
///
/// # Errors
/// [`Error::Data`] if no series has a finite point; [`Error::Io`] on write failure.
pub fn line_chart_svg(path: &std::path::Path, title: &str, x_label: &str, y_label: &str, series: &[Series<'_>]) -> Result<()> {
    let pts: Vec<(f64, f64)> = series.iter().flat_map(|(_, v)| v.iter().copied()).filter(|(x, y)| x.is_finite() && y.is_finite()).collect();
    if pts.is_empty() {
        return Err(Error::Data(format!("nothing to plot in {}", path.display())));
    }
    let (mut x0, mut x1, mut y0, mut y1) = (f64::INFINITY, f64::NEG_INFINITY, f64::INFINITY, f64::NEG_INFINITY);
    for &(x, y) in &pts {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    if x1 <= x0 {
        x1 = x0 + 1.0;
    }
    let pad = ((y1 - y0) * 0.05).max(1e-6);
    let (y0, y1) = (y0 - pad, y1 + pad);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (900, 500)).into_drawing_area();
        let draw = || -> std::result::Result<(), Box<dyn std::error::Error + '_>> {
            root.fill(&WHITE)?;
            let mut chart = ChartBuilder::on(&root)
                .caption(title, ("sans-serif", 20))
                .margin(12)
                .x_label_area_size(40)
                .y_label_area_size(60)
                .build_cartesian_2d(x0..x1, y0..y1)?;
            chart.configure_mesh().x_desc(x_label).y_desc(y_label).draw()?;
            for (i, (name, v)) in series.iter().enumerate() {
                let color = Palette99::pick(i).to_rgba();
                let v: Vec<(f64, f64)> = v.iter().copied().filter(|(x, y)| x.is_finite() && y.is_finite()).collect();
                chart
                    .draw_series(LineSeries::new(v, color.stroke_width(2)))?
                    .label(*name)
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
            }
            chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw()?;
            root.present()?;
            Ok(())
        };
        draw().map_err(|e| Error::Data(format!("plotting {}: {e}", path.display())))?;
    }
    crate::write_atomic(path, svg.as_bytes())
}
