// A small Markdown renderer for chat replies: fenced code blocks, inline code, headings, lists, quotes,
// bold, italic, links (http/https only) and paragraphs. Everything is HTML-escaped first, so a reply can
// never inject markup; an unclosed code fence (a reply still streaming) renders as an open code block.
'use strict';

(function () {
  const escapeHtml = (text) => text.replace(/&/g, '&amp;').replace(/</g, '&lt;').replace(/>/g, '&gt;')
    .replace(/"/g, '&quot;').replace(/'/g, '&#39;');

  // Inline markup on escaped text; code spans are cut out first so nothing inside them changes.
  function inline(text) {
    const codes = [];
    let out = escapeHtml(text).replace(/`([^`]+)`/g, (_, code) => {
      codes.push(code);
      return `\u0000${codes.length - 1}\u0000`;
    });
    out = out
      .replace(/\*\*([^*]+)\*\*/g, '<strong>$1</strong>')
      .replace(/(^|[^*])\*([^*\s][^*]*)\*/g, '$1<em>$2</em>')
      .replace(/\[([^\]]+)\]\((https?:\/\/[^\s)]+)\)/g, '<a href="$2" target="_blank" rel="noopener noreferrer">$1</a>');
    return out.replace(/\u0000(\d+)\u0000/g, (_, i) => `<code>${codes[Number(i)]}</code>`);
  }

  function codeBlock(lang, lines) {
    const cls = lang ? ` class="language-${escapeHtml(lang)}"` : '';
    return `<pre><code${cls}>${escapeHtml(lines.join('\n'))}</code></pre>`;
  }

  // Markdown source to an HTML string.
  function render(source) {
    const lines = source.replace(/\r\n?/g, '\n').split('\n');
    const html = [];
    let paragraph = [];
    let list = null; // {tag, items}
    const flushParagraph = () => {
      if (paragraph.length) html.push(`<p>${paragraph.map(inline).join('<br>')}</p>`);
      paragraph = [];
    };
    const flushList = () => {
      if (list) html.push(`<${list.tag}>${list.items.map((i) => `<li>${inline(i)}</li>`).join('')}</${list.tag}>`);
      list = null;
    };
    for (let i = 0; i < lines.length; i++) {
      const line = lines[i];
      const fence = line.match(/^\s*```\s*([\w+#.-]*)\s*$/);
      if (fence) {
        flushParagraph();
        flushList();
        const code = [];
        for (i++; i < lines.length && !/^\s*```\s*$/.test(lines[i]); i++) code.push(lines[i]);
        html.push(codeBlock(fence[1], code));
        continue;
      }
      const heading = line.match(/^(#{1,6})\s+(.*)$/);
      const bullet = line.match(/^\s*[-*+]\s+(.*)$/);
      const numbered = line.match(/^\s*\d+[.)]\s+(.*)$/);
      const quote = line.match(/^>\s?(.*)$/);
      if (heading) {
        flushParagraph();
        flushList();
        html.push(`<h${heading[1].length}>${inline(heading[2])}</h${heading[1].length}>`);
      } else if (bullet || numbered) {
        flushParagraph();
        const tag = bullet ? 'ul' : 'ol';
        if (list && list.tag !== tag) flushList();
        list = list || {tag, items: []};
        list.items.push((bullet || numbered)[1]);
      } else if (quote) {
        flushParagraph();
        flushList();
        html.push(`<blockquote>${inline(quote[1])}</blockquote>`);
      } else if (!line.trim()) {
        flushParagraph();
        flushList();
      } else {
        flushList();
        paragraph.push(line);
      }
    }
    flushParagraph();
    flushList();
    return html.join('');
  }

  window.renderMarkdown = render;
})();
