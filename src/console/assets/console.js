// Keyboard shortcuts for the console; every page works without this script.
//   /          focus the search box
//   g then o   overview (r review, l operations, s requeue stuck, d drift): the nav links' data-key
//   j / k      move through the rows of the page's first table; Enter follows the row's link
(() => {
  const typing = (el) => el instanceof HTMLElement && (el.isContentEditable || /^(INPUT|TEXTAREA|SELECT)$/.test(el.tagName));
  let awaitingG = false;
  let timer;

  const rowLinks = () => [...document.querySelectorAll('table.data tbody a.row-link')];
  const moveRow = (step) => {
    const links = rowLinks();
    if (links.length === 0) return;
    const at = links.indexOf(document.activeElement);
    const next = links[Math.min(links.length - 1, Math.max(0, at === -1 ? 0 : at + step))];
    next.focus();
    next.closest('tr')?.scrollIntoView({ block: 'nearest' });
  };

  document.addEventListener('keydown', (e) => {
    if (e.ctrlKey || e.metaKey || e.altKey || typing(e.target)) return;
    if (awaitingG) {
      awaitingG = false;
      clearTimeout(timer);
      const link = document.querySelector(`nav a[data-key="${CSS.escape(e.key)}"]`);
      if (link) {
        e.preventDefault();
        link.click();
      }
      return;
    }
    if (e.key === '/') {
      const search = document.getElementById('q');
      if (search) {
        e.preventDefault();
        search.focus();
        search.select();
      }
    } else if (e.key === 'g') {
      awaitingG = true;
      timer = setTimeout(() => (awaitingG = false), 1500);
    } else if (e.key === 'j') {
      moveRow(1);
    } else if (e.key === 'k') {
      moveRow(-1);
    }
  });
})();
