"""The HTML view of a schedule: a self-contained page (inline SVG, CSS and JS; nothing fetched) with hover
tooltips, the memory curves and, optionally, a second schedule drawn beneath on the same time axis."""

from __future__ import annotations

import html
import json
import math
from dataclasses import dataclass
from typing import Any

from pipesched.api.render.bars import (
    _ALL_KINDS,
    IDLE_COLOR,
    KIND_COLORS,
    KIND_NAMES,
    _bytes_unit,
    _fit_label,
    _format_bytes,
    _headline,
    _prepare,
    _rank_color,
    _RankView,
    _shade,
    _text_color,
    _View,
)
from pipesched.optimizer.result import Schedule

_SVG_WIDTH = 1360
_LEFT = 118
_RIGHT = 16


def _nice_step(span: float, target: int) -> float:
    raw = span / max(1, target)
    magnitude = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    for factor in (1, 2, 2.5, 5, 10):
        if raw <= factor * magnitude:
            return factor * magnitude
    return 10 * magnitude


@dataclass(frozen=True)
class _Panel:
    """Where one schedule's SVG panel draws (px): its Gantt rows on top, the memory plot under them, the time
    axis at the bottom; ``x(t)`` maps ms to px."""

    view: _View
    prefix: str
    row: int  # one Gantt row's height
    scale: float  # px per ms
    gantt_top: int = 8
    mem_h: int = 150
    plot_w: int = _SVG_WIDTH - _LEFT - _RIGHT

    @property
    def font(self) -> int:
        return 10 if self.row >= 16 else 8

    @property
    def mem_top(self) -> int:
        return self.gantt_top + self.row * self.view.num_rows + 34

    @property
    def axis_y(self) -> int:
        return self.mem_top + self.mem_h

    def x(self, t: float) -> float:
        return _LEFT + t * self.scale


def _svg_panel(view: _View, x_max: float, prefix: str) -> str:
    """One schedule: Gantt rows, memory curves and a time axis, as inline SVG."""
    rows = view.num_rows
    row = 30 if rows <= 4 else 24 if rows <= 8 else 16 if rows <= 16 else 11
    panel = _Panel(view, prefix, row, scale=(_SVG_WIDTH - _LEFT - _RIGHT) / x_max)
    x = panel.x
    narrowest = min((b.end - b.start for r in view.ranks for b in r.bars), default=1.0) * panel.scale
    dense = " dense" if narrowest < 4 else ""
    out: list[str] = [
        f'<svg class="panel{dense}" id="{prefix}panel" viewBox="0 0 {_SVG_WIDTH} {panel.axis_y + 34}" '
        f'xmlns="http://www.w3.org/2000/svg" data-left="{_LEFT}" data-scale="{panel.scale:.6f}" '
        f'data-memtop="{panel.mem_top}" data-memh="{panel.mem_h}" data-prefix="{prefix}">'
    ]
    step = _nice_step(x_max, 12)
    ticks = [i * step for i in range(int(x_max / step) + 1)]
    out.append('<g class="grid">')
    for t in ticks:
        out.append(f'<line x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{panel.gantt_top}" y2="{panel.axis_y}"/>')
    out.append("</g>")
    for r in view.ranks:
        out += _svg_rank(panel, r)
    out += _svg_memory(panel)
    out += _svg_time_axis(panel, ticks)
    return "".join(out)


def _svg_rank(panel: _Panel, r: _RankView) -> list[str]:
    """One rank's group: its compute row (bars labelled where the label fits) and, with data parallelism, its
    communication row."""
    view, row, x, font = panel.view, panel.row, panel.x, panel.font
    y = panel.gantt_top + view.row_of(r.rank) * row
    stages = f" (s{', s'.join(map(str, r.stages))})" if view.multi_stage else ""
    out = [
        f'<g class="rank" id="{panel.prefix}rank-{r.rank}">'
        f'<text class="ylab" x="{_LEFT - 6}" y="{y + row / 2 + 4:.1f}" font-size="{11 if row >= 16 else 8}">'
        f"rank {r.rank}{stages}</text>"
        f'<rect class="idle" x="{x(0):.2f}" y="{y + 1}" width="{view.makespan * panel.scale:.2f}" height="{row - 2}"/>'
    ]
    for i, b in enumerate(r.bars):
        color = _shade(KIND_COLORS[b.kind], b.chunk)
        w = (b.end - b.start) * panel.scale
        out.append(
            f'<rect class="act" x="{x(b.start):.2f}" y="{y + 1}" width="{max(w, 0.3):.2f}" height="{row - 2}" '
            f'fill="{color}" data-r="{r.rank}" data-i="{i}"/>'
        )
        text, size, upright = _fit_label(b, view.multi_stage, w, row - 2, font)
        center = x(b.start) + w / 2
        attrs = f'class="lab" font-size="{font * size:.1f}" fill="{_text_color(color)}"'
        if "\n" in text:
            upper, lower = text.split("\n")
            line = font * size
            out.append(
                f'<text {attrs} x="{center:.2f}" y="{y + row / 2 - line * 0.12:.1f}">{upper}'
                f'<tspan x="{center:.2f}" dy="{line * 0.95:.1f}">{lower}</tspan></text>'
            )
        elif text and upright:
            cy = y + row / 2
            out.append(
                f'<text {attrs} x="{center + font * size * 0.36:.2f}" y="{cy:.1f}" '
                f'transform="rotate(-90 {center + font * size * 0.36:.2f} {cy:.1f})">{text}</text>'
            )
        elif text:
            out.append(f'<text {attrs} x="{center:.2f}" y="{y + row / 2 + font * size * 0.36:.1f}">{text}</text>')
    if view.has_comm:
        out += _svg_comm_row(panel, r, y + row)
    out.append("</g>")
    return out


def _svg_comm_row(panel: _Panel, r: _RankView, yc: int) -> list[str]:
    """A rank's communication row at ``yc`` px: UNSHARD and REDUCE_GRAD bars (their indices follow the compute
    bars', as in :func:`_view_data`)."""
    row, x, font = panel.row, panel.x, panel.font
    out = [
        f'<text class="ylab" x="{_LEFT - 6}" y="{yc + row / 2 + 4:.1f}" font-size="{10 if row >= 16 else 7}">'
        f"comm</text>"
        f'<rect class="idle" x="{x(0):.2f}" y="{yc + 1}" width="{panel.view.makespan * panel.scale:.2f}" '
        f'height="{row - 2}"/>'
    ]
    for i, b in enumerate(r.comm_bars, start=len(r.bars)):
        color = KIND_COLORS[b.kind]
        w = (b.end - b.start) * panel.scale
        out.append(
            f'<rect class="act comm" x="{x(b.start):.2f}" y="{yc + 1}" width="{max(w, 0.6):.2f}" '
            f'height="{row - 2}" fill="{color}" data-r="{r.rank}" data-i="{i}"/>'
        )
        text, size, _ = _fit_label(b, panel.view.multi_stage, w, row - 2, font)
        if text:
            out.append(
                f'<text class="lab" font-size="{font * size:.1f}" fill="{_text_color(color)}" '
                f'x="{x(b.start) + w / 2:.2f}" y="{yc + row / 2 + font * 0.36:.1f}">{text}</text>'
            )
    return out


def _svg_memory(panel: _Panel) -> list[str]:
    """The memory plot: frame, byte grid, one curve per rank, which colour is which rank, the limits."""
    view, x, mem_top, mem_h, plot_w = panel.view, panel.x, panel.mem_top, panel.mem_h, panel.plot_w
    top = max(max(r.peak for r in view.ranks), max(view.finite_limits, default=0.0)) or 1.0
    divisor, unit = _bytes_unit(top)
    y_max = top * 1.15

    def y_mem(value: float) -> float:
        return mem_top + mem_h - value / y_max * mem_h

    out = [
        f'<rect class="memframe" x="{_LEFT}" y="{mem_top}" width="{plot_w}" height="{mem_h}"/>'
        f'<text class="axlab" x="14" y="{mem_top + mem_h / 2}" transform="rotate(-90 14 {mem_top + mem_h / 2})">'
        f"memory ({unit})</text>"
    ]
    mstep = _nice_step(y_max / divisor, 4)
    k = 0
    while k * mstep <= y_max / divisor:
        yy = y_mem(k * mstep * divisor)
        out.append(
            f'<line class="hgrid" x1="{_LEFT}" x2="{_LEFT + plot_w}" y1="{yy:.1f}" y2="{yy:.1f}"/>'
            f'<text class="tick" x="{_LEFT - 6}" y="{yy + 4:.1f}" text-anchor="end">{k * mstep:g}</text>'
        )
        k += 1
    for r in view.ranks:
        points = []
        previous: float | None = None
        for t, held in r.timeline:
            if previous is not None:
                points.append(f"{x(t):.2f},{y_mem(previous):.2f}")
            points.append(f"{x(t):.2f},{y_mem(held):.2f}")
            previous = held
        out.append(
            f'<polyline class="mem" id="{panel.prefix}memory-rank-{r.rank}" data-r="{r.rank}" '
            f'stroke="{_rank_color(r.rank, len(view.ranks))}" points="{" ".join(points)}"><title>rank {r.rank}: peak '
            f"{_format_bytes(r.peak)}, limit {_format_bytes(r.limit)}</title></polyline>"
        )
    out += _svg_rank_legend(panel)
    for value in sorted(set(view.finite_limits)):
        yy = y_mem(value)
        out.append(
            f'<line class="limit" x1="{_LEFT}" x2="{_LEFT + plot_w}" y1="{yy:.1f}" y2="{yy:.1f}"/>'
            f'<text class="limlab" x="{_LEFT + 4}" y="{yy - 4:.1f}">limit {_format_bytes(value)}</text>'
        )
    return out


def _svg_rank_legend(panel: _Panel) -> list[str]:
    """Which colour is which rank: swatches for a few ranks, else the two ends of the hue ramp."""
    ranks, mem_top = panel.view.ranks, panel.mem_top
    num_ranks = len(ranks)
    shown = ranks if num_ranks <= 8 else [ranks[0], ranks[-1]]
    legend_x = _LEFT + panel.plot_w - 8
    out = []
    for r in reversed(shown):
        stroke = _rank_color(r.rank, num_ranks)
        label = f"rank {r.rank}" if num_ranks <= 8 or r is ranks[0] else f"… rank {r.rank}"
        width = 7 * len(label) + 22
        legend_x -= width
        out.append(
            f'<line x1="{legend_x:.0f}" x2="{legend_x + 16:.0f}" y1="{mem_top + 12}" y2="{mem_top + 12}" '
            f'stroke="{stroke}" stroke-width="3"/>'
            f'<text class="tick" x="{legend_x + 20:.0f}" y="{mem_top + 16}">{label}</text>'
        )
    return out


def _svg_time_axis(panel: _Panel, ticks: list[float]) -> list[str]:
    """Tick labels (ms) under the memory plot, the axis title, and the hover cursor the page's script moves."""
    axis_y = panel.axis_y
    out = [
        f'<text class="tick" x="{panel.x(t):.1f}" y="{axis_y + 14}" text-anchor="middle">{t:g}</text>' for t in ticks
    ]
    out.append(f'<text class="axlab" x="{_LEFT + panel.plot_w / 2}" y="{axis_y + 30}">time (ms)</text>')
    out.append(
        f'<line class="cursor" x1="0" x2="0" y1="{panel.gantt_top}" y2="{axis_y}" visibility="hidden"/>'
        f'<text class="cursorlab" x="0" y="{panel.mem_top - 6}" visibility="hidden"></text></svg>'
    )
    return out


def _view_data(view: _View) -> dict[str, Any]:
    return {
        "ranks": [
            {
                "rank": r.rank,
                "limit": r.limit if math.isfinite(r.limit) else None,
                "bars": [[b.action, b.start, b.end, b.memory] for b in r.bars + r.comm_bars],
                "timeline": [[round(t, 6), b] for t, b in r.timeline],
            }
            for r in view.ranks
        ]
    }


def _summary_html(view: _View, heading: str) -> str:
    first, second = _headline(view)
    return f"<h2>{html.escape(heading)}</h2><p class='sub'>{html.escape(first)}<br><b>{html.escape(second)}</b></p>"


_CSS = """
body{font:14px system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;margin:16px 24px;color:#222;background:#fff}
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:18px 0 2px}.sub{margin:0 0 6px;color:#333}
.legend span{display:inline-block;margin-right:16px;font-size:13px}
.legend i{display:inline-block;width:14px;height:14px;vertical-align:-2px;margin-right:5px;border-radius:2px}
svg.panel{width:100%;height:auto;display:block}
.grid line{stroke:#ddd;stroke-width:1}.hgrid{stroke:#eee;stroke-width:1}
.idle{fill:#E4E4E4}.act{stroke:#fff;stroke-width:.4}.dense .act{stroke:none}
.act.focus{stroke:#000;stroke-width:2}.act:hover{stroke:#000;stroke-width:1.5}
.lab{text-anchor:middle;pointer-events:none;font-family:system-ui,sans-serif}
.ylab{text-anchor:end;fill:#333}.tick{font-size:11px;fill:#444}.axlab{font-size:12px;fill:#333;text-anchor:middle}
.memframe{fill:none;stroke:#bbb}.mem{fill:none;stroke-width:1.4}.mem:hover{stroke-width:3}
.limit{stroke:#C00000;stroke-dasharray:6 4;stroke-width:1.3}.limlab{font-size:11px;fill:#C00000}
.cursor{stroke:#000;stroke-width:1;stroke-dasharray:2 2;pointer-events:none}
.cursorlab{font-size:11px;fill:#000;pointer-events:none}
#tip{position:fixed;pointer-events:none;background:rgba(20,20,20,.92);color:#fff;padding:6px 9px;
border-radius:4px;font-size:12px;line-height:1.45;display:none;z-index:9;white-space:nowrap}
"""

_JS = """
(function(){
const DATA=JSON.parse(document.getElementById('pipesched-data').textContent);
const tip=document.getElementById('tip');
function fmtB(v){if(v===null||v===undefined)return 'none';const u=['B','KiB','MiB','GiB','TiB'];let i=0;
 while(Math.abs(v)>=1024&&i<4){v/=1024;i++;}return i?v.toFixed(2)+' '+u[i]:v.toFixed(0)+' B';}
function memAt(tl,t){let lo=0,hi=tl.length-1;
 while(lo<hi){const mid=(lo+hi+1)>>1;if(tl[mid][0]<=t+1e-9)lo=mid;else hi=mid-1;}
 return tl[lo][1];}
function show(e,h){tip.innerHTML=h;tip.style.display='block';
 const w=tip.offsetWidth;tip.style.left=Math.min(e.clientX+14,window.innerWidth-w-8)+'px';
 tip.style.top=(e.clientY+14)+'px';}
function barTip(d,rank,i){const r=d.ranks[rank];const b=r.bars[i];
 return '<b>'+b[0]+'</b> on rank '+r.rank+'<br>start '+b[1].toFixed(3)+' ms · end '+b[2].toFixed(3)+
  ' ms<br>duration '+(b[2]-b[1]).toFixed(3)+' ms<br>memory '+fmtB(b[3])+(r.limit!==null?' of '+fmtB(r.limit):'');}
document.querySelectorAll('svg.panel').forEach(function(svg){
 const key=svg.dataset.prefix?'compare':'main';const d=DATA[key];
 const left=+svg.dataset.left,scale=+svg.dataset.scale,memTop=+svg.dataset.memtop,memH=+svg.dataset.memh;
 const cur=svg.querySelector('.cursor'),lab=svg.querySelector('.cursorlab');
 svg.addEventListener('mousemove',function(e){
  const pt=svg.createSVGPoint();pt.x=e.clientX;pt.y=e.clientY;const p=pt.matrixTransform(svg.getScreenCTM().inverse());
  const t=(p.x-left)/scale;if(t<0){cur.setAttribute('visibility','hidden');lab.setAttribute('visibility','hidden');
   tip.style.display='none';return;}
  cur.setAttribute('x1',p.x);cur.setAttribute('x2',p.x);cur.setAttribute('visibility','visible');
  lab.setAttribute('x',p.x+4);lab.textContent=t.toFixed(2)+' ms';lab.setAttribute('visibility','visible');
  const el=e.target;
  if(el.classList.contains('act')){show(e,barTip(d,+el.dataset.r,+el.dataset.i));
  }else if(p.y>=memTop&&p.y<=memTop+memH){
   let rows=d.ranks.map(function(r){return [r.rank,memAt(r.timeline,t),r.limit];});
   rows.sort(function(a,b){return b[1]-a[1];});const more=rows.length>8?'<br>… '+(rows.length-8)+' more ranks':'';
   show(e,'<b>t = '+t.toFixed(2)+' ms</b><br>'+rows.slice(0,8).map(function(x){return 'rank '+x[0]+': '+fmtB(x[1])+
    (x[2]!==null?' ('+(100*x[1]/x[2]).toFixed(0)+'% of limit)':'');}).join('<br>')+more);
  }else if(el.classList.contains('idle')){show(e,'idle · t = '+t.toFixed(2)+' ms');}
  else{tip.style.display='none';}
 });
 svg.addEventListener('mouseleave',function(){tip.style.display='none';cur.setAttribute('visibility','hidden');
  lab.setAttribute('visibility','hidden');});
});
// A link to one action: view#at=3F12 outlines it and shows its tooltip.
const at=decodeURIComponent(location.hash).match(/^#at=(\\d+[FIWB]\\d+)$/);
if(at){DATA.main.ranks.forEach(function(r,rank){r.bars.forEach(function(b,i){if(b[0]!==at[1])return;
 const el=document.querySelector('#panel rect.act[data-r="'+rank+'"][data-i="'+i+'"]');if(!el)return;
 el.classList.add('focus');el.scrollIntoView({block:'center'});const box=el.getBoundingClientRect();
 show({clientX:box.right,clientY:box.bottom},barTip(DATA.main,rank,i));});});}
document.body.dataset.ready=String(document.querySelectorAll('svg.panel rect.act').length);
})();
"""


def render_view_html(schedule: Schedule, compare: Schedule | None = None) -> str:
    """A self-contained HTML page of ``schedule`` (and ``compare`` beneath it, on the same time axis).

    Inline SVG, CSS and JS only; the page fetches nothing. Hovering an action shows its name, rank, start,
    end, duration (ms) and the rank's memory while it runs (bytes, and of the limit); hovering the memory
    panel shows every rank's memory at that time.

    Raises:
        ValueError: ``schedule`` (or ``compare``) is infeasible and has nothing to draw.
    """
    views = [_prepare(schedule)] + ([_prepare(compare)] if compare is not None else [])
    x_max = max(v.makespan for v in views) or 1.0
    kinds = [k for k in _ALL_KINDS if any(k in v.kinds for v in views)]
    legend = "".join(f'<span><i style="background:{KIND_COLORS[k]}"></i>{KIND_NAMES[k]}</span>' for k in kinds)
    if any(v.multi_stage for v in views):
        legend += (
            f'<span><i style="background:{_shade(KIND_COLORS["F"], 1)}"></i>lighter: the rank\'s later stage '
            "(a label s5·3 is stage 5, microbatch 3)</span>"
        )
    legend += f'<span><i style="background:{IDLE_COLOR}"></i>idle</span>'
    body = [f'<div class="legend">{legend}</div>', _summary_html(views[0], "Schedule"), _svg_panel(views[0], x_max, "")]
    data: dict[str, Any] = {"main": _view_data(views[0])}
    if compare is not None:
        body += [_summary_html(views[1], f"Compared with {compare.method}"), _svg_panel(views[1], x_max, "compare-")]
        data["compare"] = _view_data(views[1])
    title = f"pipesched · {schedule.method} · {schedule.problem.pipeline.num_ranks} ranks"
    payload = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    return (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        f"<meta name='viewport' content='width=device-width'><title>{html.escape(title)}</title>"
        f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1>"
        + "".join(body)
        + f'<div id="tip"></div><script type="application/json" id="pipesched-data">{payload}</script>'
        f"<script>{_JS}</script></body></html>"
    )
