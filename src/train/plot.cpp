// `gdntrain plot RUN_DIR`: a dependency-free SVG of metrics.jsonl (training loss per step, eval
// loss and, for MQAR, eval accuracy on a second axis). Hand-written: no plotting library is
// packaged for C++ in Debian that would be worth the dependency for two polylines.
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "gdn/core/error.h"
#include "gdn/core/safetensors.h"
#include "train/trainer.h"

namespace gdn::train {

namespace {
struct Series {
  std::vector<double> x, y;
};

std::string polyline(const Series& s, double x0, double x1, double y0, double y1, const char* color,
                     double dash) {
  if (s.x.empty()) return "";
  std::string pts;
  for (size_t i = 0; i < s.x.size(); ++i) {
    double px = 60 + 520 * (s.x[i] - x0) / std::max(1e-12, x1 - x0);
    double py = 330 - 300 * (s.y[i] - y0) / std::max(1e-12, y1 - y0);
    pts += fmt::format("{:.1f},{:.1f} ", px, py);
  }
  return fmt::format(
      "<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"1.5\"{} points=\"{}\"/>\n", color,
      dash > 0 ? fmt::format(" stroke-dasharray=\"{}\"", dash) : "", pts);
}
}  // namespace

std::string plot_run(const std::string& run_dir) {
  const std::string path = run_dir + "/metrics.jsonl";
  std::ifstream in(path);
  GDN_CHECK_HINT(in.good(), "give the run directory of a `gdntrain train` run", "cannot read '{}'",
                 path);
  Series loss, eval_loss, acc;
  std::string line;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.contains("step")) continue;
    double step = j["step"].get<double>();
    if (j.contains("loss") && j["loss"].is_number() && std::isfinite(j["loss"].get<double>())) {
      loss.x.push_back(step);
      loss.y.push_back(j["loss"].get<double>());
    }
    if (j.contains("eval_loss")) {
      eval_loss.x.push_back(step);
      eval_loss.y.push_back(j["eval_loss"].get<double>());
    }
    if (j.contains("eval_accuracy")) {
      acc.x.push_back(step);
      acc.y.push_back(j["eval_accuracy"].get<double>());
    }
  }
  GDN_CHECK(!loss.x.empty(), "'{}' holds no training steps", path);
  double x1 = loss.x.back(), y0 = 0, y1 = 0;
  for (double v : loss.y) y1 = std::max(y1, v);
  for (double v : eval_loss.y) y1 = std::max(y1, v);
  y1 *= 1.05;
  std::string svg = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"640\" height=\"380\" "
      "font-family=\"sans-serif\" font-size=\"11\">\n"
      "<rect width=\"640\" height=\"380\" fill=\"white\"/>\n"
      "<line x1=\"60\" y1=\"330\" x2=\"580\" y2=\"330\" stroke=\"black\"/>\n"
      "<line x1=\"60\" y1=\"30\" x2=\"60\" y2=\"330\" stroke=\"black\"/>\n"
      "<text x=\"320\" y=\"365\" text-anchor=\"middle\">step (0 .. {:.0f})</text>\n"
      "<text x=\"55\" y=\"34\" text-anchor=\"end\">{:.3g}</text>\n"
      "<text x=\"55\" y=\"330\" text-anchor=\"end\">0</text>\n"
      "<text x=\"70\" y=\"20\" fill=\"#1f77b4\">train loss</text>\n"
      "<text x=\"150\" y=\"20\" fill=\"#d62728\">eval loss</text>\n",
      x1, y1);
  svg += polyline(loss, 0, x1, y0, y1, "#1f77b4", 0);
  svg += polyline(eval_loss, 0, x1, y0, y1, "#d62728", 4);
  if (!acc.x.empty()) {
    svg +=
        "<line x1=\"580\" y1=\"30\" x2=\"580\" y2=\"330\" stroke=\"#2ca02c\"/>\n"
        "<text x=\"585\" y=\"34\" fill=\"#2ca02c\">1.0</text>\n"
        "<text x=\"585\" y=\"330\" fill=\"#2ca02c\">0</text>\n"
        "<text x=\"225\" y=\"20\" fill=\"#2ca02c\">eval accuracy (right axis)</text>\n";
    svg += polyline(acc, 0, x1, 0, 1, "#2ca02c", 2);
  }
  svg += "</svg>\n";
  std::string out = run_dir + "/loss.svg";
  write_file_atomic(out, svg);
  return out;
}

}  // namespace gdn::train
