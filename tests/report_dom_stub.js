// Runs a written report's own script under Node with a stand-in DOM (a stub: no layout, no browser),
// so that a test sees the page's script throw, or draw NaN into an SVG attribute, without a browser.
// Usage: node report_dom_stub.js REPORT.html  -> prints one JSON line: each chart's title and SVG size.
const fs = require("fs");
const html = fs.readFileSync(process.argv[2], "utf8");
const data = html.split('id="report-data">')[1].split("</script>")[0];
class Node {}
global.Node = Node;
function make(tag) {
  return Object.assign(new Node(), {
    tag, children: [], attrs: {}, style: {}, dataset: {}, textContent: "", innerHTML: "",
    classList: { add() {}, remove() {}, toggle() {}, contains() { return false; } },
    append(...c) { this.children.push(...c); },
    appendChild(c) { this.children.push(c); return c; },
    replaceChildren(...c) { this.children = c; },
    insertBefore(c) { this.children.push(c); },
    setAttribute(k, v) {
      if (String(v).includes("NaN") || String(v).includes("Infinity")) throw new Error(`${tag} ${k}=${v}`);
      this.attrs[k] = v;
    },
    addEventListener() {}, querySelectorAll() { return []; }, querySelector() { return null; }, remove() {},
  });
}
const byId = {};
global.window = { addEventListener() {}, location: { hash: "" } };
global.document = {
  createElementNS: (ns, t) => make(t), createElement: make, createTextNode: (t) => ({ t }),
  getElementById: (id) => (id === "report-data" ? { textContent: data } : (byId[id] = byId[id] || make(id))),
  querySelectorAll: () => [], querySelector: () => null, addEventListener() {}, body: make("body"),
};
for (const m of html.matchAll(/<script>([\s\S]*?)<\/script>/g)) eval(m[1]);
const grid = byId["chart-grid"] ? byId["chart-grid"].children : [];
console.log(JSON.stringify(grid.map((box) => ({
  title: box.children[0] ? box.children[0].textContent : "",
  marks: (box.children.find((c) => c.tag === "svg") || { children: [] }).children.length,
}))));
