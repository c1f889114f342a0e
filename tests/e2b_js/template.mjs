// E2B template builds from the JS SDK against dsec: a build with a copy from a context dir,
// its logs streamed, then a sandbox from it. E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY and
// CTX (the build context) come from the test.
import { Sandbox, Template } from 'e2b'

const logs = []
const t = Template({ fileContextPath: process.env.CTX })
  .fromImage('debian:12')
  .copy('app/data.txt', '/opt/js/data.txt')
  .runCmd('echo built-by-js > /opt/js/marker')
  .setEnvs({ FROM_JS: 'yes' })
const info = await Template.build(t, 'tpl-js', { onBuildLogs: (e) => logs.push(e.message) })
const sbx = await Sandbox.create('tpl-js', { timeoutMs: 60_000 })
const out = {
  built: Boolean(info.templateId && info.buildId),
  logged: logs.some((m) => m.includes('echo built-by-js')),
  files: (await sbx.commands.run('cat /opt/js/marker /opt/js/data.txt; echo $FROM_JS')).stdout,
  exists: await Template.exists('tpl-js'),
}
await sbx.kill()
console.log(JSON.stringify(out))
