// A small Markdown renderer for model replies: paragraphs (line breaks kept), ``` code fences,
// `inline code`, **bold**, *italic*, ~~strike~~, headings, flat lists, block quotes, rules and
// http(s) links. Every character of the input is HTML-escaped before any markup is added, so the
// output contains no tag or attribute the text did not earn through Markdown syntax.
"use strict";

(function () {
  const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

  function escapeHtml(s) {
    return s.replace(/[&<>"']/g, (c) => ESCAPES[c]);
  }

  // Inline markup of one escaped line. Code spans are cut out first so nothing inside them is
  // interpreted; placeholders use U+0000, which the input cannot contain (render drops it).
  function inline(raw) {
    const codes = [];
    let s = escapeHtml(raw).replace(/`([^`]+)`/g, (_, c) => {
      codes.push("<code>" + c + "</code>");
      return "\u0000" + (codes.length - 1) + "\u0000";
    });
    s = s
      .replace(/\[([^\]]+)\]\((https?:\/\/[^\s)]+)\)/g,
        '<a href="$2" target="_blank" rel="noopener noreferrer">$1</a>')
      .replace(/\*\*(?=\S)([^*]*?\S)\*\*/g, "<strong>$1</strong>")
      .replace(/(^|[^\w])__(?=\S)(.*?\S)__(?=[^\w]|$)/g, "$1<strong>$2</strong>")
      .replace(/\*(?=\S)([^*]*?\S)\*/g, "<em>$1</em>")
      .replace(/(^|[^\w])_(?=\S)([^_]*?\S)_(?=[^\w]|$)/g, "$1<em>$2</em>")
      .replace(/~~(?=\S)(.*?\S)~~/g, "<del>$1</del>");
    return s.replace(/\u0000(\d+)\u0000/g, (_, i) => codes[Number(i)]);
  }

  const FENCE = /^\s*```\s*([\w+#.-]*)\s*$/;
  const HEADING = /^(#{1,6})\s+(.*)$/;
  const BULLET = /^\s*[-*+]\s+(.*)$/;
  const NUMBERED = /^\s*(\d+)[.)]\s+(.*)$/;
  const QUOTE = /^\s*>\s?(.*)$/;
  const RULE = /^\s*([-*_])(\s*\1){2,}\s*$/;

  // Markdown text -> HTML. An unclosed fence (a reply still streaming) renders as code up to the
  // end.
  function render(text) {
    const lines = String(text).replace(/\u0000/g, "").replace(/\r\n?/g, "\n").split("\n");
    const out = [];
    let para = [];
    let list = null; // { tag: "ul" | "ol", items: [] , start }
    const flushPara = () => {
      if (para.length) out.push("<p>" + para.map(inline).join("<br>") + "</p>");
      para = [];
    };
    const flushList = () => {
      if (!list) return;
      const start = list.tag === "ol" && list.start !== 1 ? ' start="' + list.start + '"' : "";
      out.push("<" + list.tag + start + ">" +
        list.items.map((i) => "<li>" + inline(i) + "</li>").join("") + "</" + list.tag + ">");
      list = null;
    };
    const flush = () => { flushPara(); flushList(); };
    for (let i = 0; i < lines.length; i++) {
      const line = lines[i];
      const fence = FENCE.exec(line);
      if (fence) {
        flush();
        const body = [];
        for (i++; i < lines.length && !FENCE.test(lines[i]); i++) body.push(lines[i]);
        const lang = fence[1] ? ' class="language-' + escapeHtml(fence[1]) + '"' : "";
        out.push("<pre><code" + lang + ">" + escapeHtml(body.join("\n")) + "</code></pre>");
        continue;
      }
      if (!line.trim()) { flush(); continue; }
      let m;
      if ((m = HEADING.exec(line))) {
        flush();
        const n = m[1].length;
        out.push("<h" + n + ">" + inline(m[2]) + "</h" + n + ">");
      } else if (RULE.test(line)) {
        flush();
        out.push("<hr>");
      } else if ((m = BULLET.exec(line)) || (m = NUMBERED.exec(line))) {
        flushPara();
        const ordered = m.length === 3;
        const tag = ordered ? "ol" : "ul";
        if (!list || list.tag !== tag) {
          flushList();
          list = { tag, items: [], start: ordered ? Number(m[1]) : 1 };
        }
        list.items.push(ordered ? m[2] : m[1]);
      } else if ((m = QUOTE.exec(line))) {
        flush();
        out.push("<blockquote>" + inline(m[1]) + "</blockquote>");
      } else if (list && /^\s+\S/.test(line)) {
        // A continuation line of the last list item.
        list.items[list.items.length - 1] += " " + line.trim();
      } else {
        flushList();
        para.push(line);
      }
    }
    flush();
    return out.join("\n");
  }

  window.mferenceMarkdown = { render, escapeHtml };
})();
